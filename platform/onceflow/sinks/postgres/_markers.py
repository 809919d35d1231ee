"""The PostgreSQL sinks' protocol tables (created by the group's `prepare`) and the commit
markers: one row per window (or restatement) and sink, written by the transaction that
committed it, the authority on what a sink holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from onceflow._ledger_schema import DETAIL_DDL
from onceflow.sinks.postgres._folded import FOLDED_DDL, marker_holds
from onceflow.sinks.postgres._held import VERIFIED_DDL

PROTOCOL_DDL = """
CREATE SCHEMA IF NOT EXISTS onceflow;
CREATE TABLE IF NOT EXISTS onceflow.sink_commits (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    epoch bigint NOT NULL,
    xid xid8 NOT NULL,
    run_id text,
    offsets jsonb NOT NULL,
    rows_written bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink, window_id)
);
CREATE TABLE IF NOT EXISTS onceflow.restate_commits (
    job text NOT NULL,
    sink text NOT NULL,
    seq bigint NOT NULL,
    xid xid8 NOT NULL,
    rows_written bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink, seq)
);
-- What a window added to an accumulating sink, so a restatement can take it back: one row per
-- window, each key column's values and each accumulated column's sums as one array
-- (`keys[c][r]`, `amounts[c][r]` for the window's r-th key). A row per key (a heap tuple, an
-- index entry and two jsonb values each) cost two and a half times the insert and twelve
-- times the space (benchmarks/postgres_statements_bench.py).
CREATE TABLE IF NOT EXISTS onceflow.window_contributions (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    keys text[] NOT NULL,
    amounts numeric[] NOT NULL,
    PRIMARY KEY (job, sink, window_id)
);
-- Earlier versions kept a row per key here; their windows are still read from it.
CREATE TABLE IF NOT EXISTS onceflow.contributions (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    key jsonb NOT NULL,
    amounts jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS contributions_window ON onceflow.contributions (job, sink, window_id);
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = 'onceflow.contributions'::regclass AND conname = 'contributions_pkey'
    ) THEN
        ALTER TABLE onceflow.contributions DROP CONSTRAINT contributions_pkey;
    END IF;
END
$$;
"""


def create_protocol_tables(conn: psycopg.Connection) -> None:
    """The protocol tables above, the folded markers (`_folded`), the verified point
    (`_held`), and the ledger's detail
    point the contributions' reads consult (`onceflow.detail_pruned`), if missing."""
    conn.execute(PROTOCOL_DDL)
    conn.execute(FOLDED_DDL)
    conn.execute(VERIFIED_DDL)
    conn.execute(DETAIL_DDL)


_INSERT_MARKER = (
    "INSERT INTO onceflow.sink_commits (job, sink, window_id, epoch, xid, run_id, offsets,"
    " rows_written) VALUES (%s, %s, %s, %s, pg_current_xact_id(), %s, %s, %s)"
)


# Without marker checks (at_least_once) a replay writes again; the marker counts every write.
_UPSERT_MARKER = (
    _INSERT_MARKER + " ON CONFLICT (job, sink, window_id) DO UPDATE SET epoch = EXCLUDED.epoch,"
    " xid = EXCLUDED.xid, run_id = EXCLUDED.run_id,"
    " rows_written = onceflow.sink_commits.rows_written + EXCLUDED.rows_written,"
    " committed_at = now()"
)


@dataclass(frozen=True)
class Marker:
    """The commit record of one window (or one restatement of it) in one sink."""

    job: str
    sink: str
    window_id: int
    restate_seq: int | None = None

    def epoch_of(self, conn: psycopg.Connection) -> int | None:
        """The epoch that wrote this marker (0 for a restatement's), or None if there is none."""
        if self.restate_seq is not None:
            return 0 if self.exists(conn) else None
        row = conn.execute(
            "SELECT epoch FROM onceflow.sink_commits WHERE job = %s AND sink = %s AND window_id = %s",
            (self.job, self.sink, self.window_id),
        ).fetchone()
        return None if row is None else int(row[0])

    def exists(self, conn: psycopg.Connection) -> bool:
        if self.restate_seq is not None:
            query = (
                "SELECT 1 FROM onceflow.restate_commits WHERE job = %s AND sink = %s AND seq = %s"
            )
            return (
                conn.execute(query, (self.job, self.sink, self.restate_seq)).fetchone() is not None
            )
        # A window past the detail horizon may have its marker folded (`_folded`).
        return marker_holds(conn, self.job, self.sink, self.window_id)

    def insert(
        self,
        conn: psycopg.Connection,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        rows: int,
        *,
        exactly_once: bool,
    ) -> None:
        if self.restate_seq is not None:
            conn.execute(
                "INSERT INTO onceflow.restate_commits (job, sink, seq, xid, rows_written)"
                " VALUES (%s, %s, %s, pg_current_xact_id(), %s)",
                (self.job, self.sink, self.restate_seq, rows),
            )
            return
        conn.execute(
            _INSERT_MARKER if exactly_once else _UPSERT_MARKER,
            (self.job, self.sink, self.window_id, epoch, run_id, json.dumps(offsets), rows),
        )


def marker_xids(
    conn: psycopg.Connection, job: str, sinks: list[str], window_ids: Sequence[int]
) -> list[tuple[str, int, str]]:
    """(sink, window, the id of the transaction that wrote its marker) for those of
    `window_ids` the sinks hold."""
    return conn.execute(
        "SELECT sink, window_id, xid::text FROM onceflow.sink_commits"
        " WHERE job = %s AND sink = ANY(%s) AND window_id = ANY(%s)",
        (job, sinks, sorted(set(window_ids))),
    ).fetchall()
