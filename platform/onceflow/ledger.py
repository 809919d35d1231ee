"""The ledger: a job's epochs and its write-ahead plan of windows, kept in PostgreSQL.

The sinks are the truth about what was committed; the ledger holds the plan (which input each
window covers) so that a replay reads exactly the same input, and it can be rebuilt from the
offsets every sink commit records.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from onceflow import faults
from onceflow._identifiers import session_name
from onceflow.errors import FencedError, LedgerError
from onceflow.postgres import connect

_log = logging.getLogger(__name__)

SCHEMA = "onceflow"
# A newer run waits at most this long for an older run's locks before it ends that run's sessions.
LOCK_WAIT_S = 5
# The server ends a session left idle inside a transaction (a frozen run) after this long.
IDLE_IN_TRANSACTION_TIMEOUT = "60s"

_DDL = """
CREATE SCHEMA IF NOT EXISTS onceflow;
CREATE TABLE IF NOT EXISTS onceflow.jobs (
    job text PRIMARY KEY,
    epoch bigint NOT NULL,
    run_id text,
    epoch_started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS onceflow.windows (
    job text NOT NULL,
    window_id bigint NOT NULL,
    offsets jsonb NOT NULL,
    epoch bigint NOT NULL,
    planned_at timestamptz NOT NULL DEFAULT now(),
    stats jsonb,
    completed_at timestamptz,
    PRIMARY KEY (job, window_id)
);
CREATE TABLE IF NOT EXISTS onceflow.source_units (
    job text NOT NULL,
    unit text NOT NULL,
    window_id bigint NOT NULL,
    PRIMARY KEY (job, unit)
);
CREATE TABLE IF NOT EXISTS onceflow.restatements (
    job text NOT NULL,
    seq bigint NOT NULL,
    window_id bigint NOT NULL,
    request_id text NOT NULL,
    epoch bigint NOT NULL,
    planned_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    PRIMARY KEY (job, seq),
    UNIQUE (job, request_id)
);
CREATE TABLE IF NOT EXISTS onceflow.reconciliations (
    job text NOT NULL,
    sink text NOT NULL,
    verified_through bigint NOT NULL,
    verified_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
"""


@dataclass(frozen=True)
class Window:
    """One window of a job: an immutable slice of the source, identified by a dense id."""

    job: str
    window_id: int
    offsets: dict[str, Any]
    epoch: int
    stats: dict[str, Any] | None = field(default=None, compare=False)
    completed: bool = field(default=False, compare=False)


class Ledger:
    """Epochs and the window plan of one job."""

    def __init__(self, dsn: str, job: str) -> None:
        self._dsn = dsn
        self.job = job

    def connect(self, epoch: int | None = None) -> psycopg.Connection:
        conn = connect(self._dsn, application_name=session_name(self.job, epoch))
        conn.execute(
            sql.SQL("SET idle_in_transaction_session_timeout = {}").format(
                sql.Literal(IDLE_IN_TRANSACTION_TIMEOUT)
            )
        )
        conn.commit()
        return conn

    def ensure_schema(self) -> None:
        """Create the ledger tables if they are missing (idempotent, safe to race)."""
        with self.connect() as conn:
            # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog; serialise.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
            conn.execute(_DDL)
            conn.commit()

    # -- epochs -------------------------------------------------------------------------------

    def acquire_epoch(self, run_id: str, floor: int = 0) -> int:
        """Take a new epoch, higher than any before and than `floor`, fencing older runs.

        An older run that is frozen while holding the job's row lock would block this forever;
        after LOCK_WAIT_S its sessions are ended so the newer run can go on.
        """
        deadline = time.monotonic() + 6 * LOCK_WAIT_S
        while True:
            with self.connect() as conn:
                conn.execute(
                    sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{LOCK_WAIT_S}s"))
                )
                try:
                    row = conn.execute(
                        """
                        INSERT INTO onceflow.jobs AS j (job, epoch, run_id)
                        VALUES (%(job)s, %(floor)s + 1, %(run_id)s)
                        ON CONFLICT (job) DO UPDATE
                           SET epoch = greatest(j.epoch, %(floor)s) + 1, run_id = %(run_id)s,
                               epoch_started_at = now(), heartbeat_at = now()
                        RETURNING epoch
                        """,
                        {"job": self.job, "floor": floor, "run_id": run_id},
                    ).fetchone()
                    conn.commit()
                    assert row is not None
                    return int(row[0])
                except psycopg.errors.LockNotAvailable:
                    conn.rollback()
                    if time.monotonic() > deadline:
                        raise LedgerError(
                            f"job {self.job!r}: could not take a new epoch: another session keeps "
                            "the job's row locked and could not be ended. Check "
                            "pg_stat_activity for sessions named onceflow/" + self.job
                        ) from None
                    ended = self._end_older_sessions(conn)
                    _log.warning("job %s: ended %d session(s) of an older run", self.job, ended)

    def _end_older_sessions(self, conn: psycopg.Connection) -> int:
        rows = conn.execute(
            """
            SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name LIKE %s AND application_name <> %s
               AND pid <> pg_backend_pid()
            """,
            (f"onceflow/{self.job}/e%", session_name(self.job, None)),
        ).fetchall()
        conn.commit()
        return sum(1 for (ok,) in rows if ok)

    def current_epoch(self) -> int | None:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT epoch FROM onceflow.jobs WHERE job = %s", (self.job,)
            ).fetchone()
            return None if row is None else int(row[0])

    def fence(self, conn: psycopg.Connection, epoch: int) -> None:
        """Inside `conn`'s open transaction, lock the job row if `epoch` is still current.

        Raises FencedError when a newer run has taken over. The lock is held until the
        transaction ends, so a newer run cannot take over halfway through a commit.
        """
        cur = conn.execute(
            "UPDATE onceflow.jobs SET heartbeat_at = now() WHERE job = %s AND epoch = %s",
            (self.job, epoch),
        )
        if cur.rowcount != 1:
            raise FencedError(
                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a newer run; it "
                "stopped without writing. The newer run owns the job now."
            )

    def check_epoch(self, epoch: int) -> None:
        """Raise FencedError if a newer run has taken over."""
        current = self.current_epoch()
        if current != epoch:
            raise FencedError(
                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a newer run (epoch "
                f"{current}); it stopped without writing. The newer run owns the job now."
            )

    # -- windows ------------------------------------------------------------------------------

    def windows(self, *, pending_only: bool = False, since: int = 0) -> list[Window]:
        query = sql.SQL(
            "SELECT window_id, offsets, epoch, stats, completed_at IS NOT NULL"
            " FROM onceflow.windows WHERE job = %s AND window_id > %s {} ORDER BY window_id"
        ).format(sql.SQL("AND completed_at IS NULL") if pending_only else sql.SQL(""))
        with self.connect() as conn:
            rows = conn.execute(query, (self.job, since)).fetchall()
        return [Window(self.job, int(w), o, int(e), s, bool(c)) for w, o, e, s, c in rows]

    def window(self, window_id: int) -> Window | None:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT offsets, epoch, stats, completed_at IS NOT NULL FROM onceflow.windows"
                " WHERE job = %s AND window_id = %s",
                (self.job, window_id),
            ).fetchone()
        if row is None:
            return None
        return Window(self.job, window_id, row[0], int(row[1]), row[2], bool(row[3]))

    def last_window_id(self) -> int:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT coalesce(max(window_id), 0) FROM onceflow.windows WHERE job = %s",
                (self.job,),
            ).fetchone()
        return int(row[0]) if row else 0

    def unplanned(self, units: Sequence[str]) -> list[str]:
        """The source units (in the given order) that no window has taken yet."""
        if not units:
            return []
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT p FROM unnest(%s::text[]) WITH ORDINALITY AS u(p, i)"
                " WHERE NOT EXISTS (SELECT 1 FROM onceflow.source_units f"
                "                   WHERE f.job = %s AND f.unit = u.p) ORDER BY i",
                (list(units), self.job),
            ).fetchall()
        return [p for (p,) in rows]

    def last_offsets(self) -> dict[str, Any] | None:
        """The offsets of the newest planned window (None before the first)."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT offsets FROM onceflow.windows WHERE job = %s"
                " ORDER BY window_id DESC LIMIT 1",
                (self.job,),
            ).fetchone()
        return None if row is None else dict(row[0])

    def plan_window(self, epoch: int, offsets: dict[str, Any], units: Iterable[str]) -> Window:
        """Write a new window ahead of processing it (fenced; its units are taken for good)."""
        with self.connect(epoch) as conn:
            self.fence(conn, epoch)
            row = conn.execute(
                "SELECT coalesce(max(window_id), 0) + 1 FROM onceflow.windows WHERE job = %s",
                (self.job,),
            ).fetchone()
            assert row is not None
            window_id = int(row[0])
            conn.execute(
                "INSERT INTO onceflow.windows (job, window_id, offsets, epoch)"
                " VALUES (%s, %s, %s, %s)",
                (self.job, window_id, json.dumps(offsets), epoch),
            )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO onceflow.source_units (job, unit, window_id) VALUES (%s, %s, %s)",
                    [(self.job, unit, window_id) for unit in units],
                )
            faults.point("plan", window_id)
            conn.commit()
        return Window(self.job, window_id, offsets, epoch)

    def restore_window(self, window: Window, units: Iterable[str]) -> None:
        """Put back a window rebuilt from the sinks' commit records (ledger loss)."""
        with self.connect() as conn:
            conn.execute(
                "INSERT INTO onceflow.windows (job, window_id, offsets, epoch) VALUES"
                " (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (self.job, window.window_id, json.dumps(window.offsets), window.epoch),
            )
            self._index_units(conn, [(u, window.window_id) for u in units])
            conn.commit()

    def restore_units(self, units: Iterable[tuple[str, int]]) -> None:
        """Re-create the unit index (unit, window id) from the windows' offsets."""
        with self.connect() as conn:
            self._index_units(conn, list(units))
            conn.commit()

    def _index_units(self, conn: psycopg.Connection, units: list[tuple[str, int]]) -> None:
        if not units:
            return
        conn.execute(
            "INSERT INTO onceflow.source_units (job, unit, window_id)"
            " SELECT %s, u, w FROM unnest(%s::text[], %s::bigint[]) AS x(u, w)"
            " ON CONFLICT DO NOTHING",
            (self.job, [u for u, _ in units], [w for _, w in units]),
        )

    def indexed_windows(self) -> set[int]:
        """Windows that have at least one unit in the index."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT DISTINCT window_id FROM onceflow.source_units WHERE job = %s", (self.job,)
            ).fetchall()
        return {int(w) for (w,) in rows}

    def record_stats(self, window_id: int, stats: dict[str, Any]) -> None:
        with self.connect() as conn:
            conn.execute(
                "UPDATE onceflow.windows SET stats = %s WHERE job = %s AND window_id = %s",
                (json.dumps(stats), self.job, window_id),
            )
            conn.commit()

    def mark_completed(self, window_id: int) -> None:
        with self.connect() as conn:
            conn.execute(
                "UPDATE onceflow.windows SET completed_at = now()"
                " WHERE job = %s AND window_id = %s AND completed_at IS NULL",
                (self.job, window_id),
            )
            conn.commit()

    def plan_restatement(self, epoch: int, window_id: int, request_id: str) -> int:
        """Write a restatement ahead; the same request always gets the same sequence number."""
        with self.connect(epoch) as conn:
            self.fence(conn, epoch)
            row = conn.execute(
                "SELECT seq FROM onceflow.restatements WHERE job = %s AND request_id = %s",
                (self.job, request_id),
            ).fetchone()
            if row is None:
                row = conn.execute(
                    "INSERT INTO onceflow.restatements (job, seq, window_id, request_id, epoch)"
                    " SELECT %s, coalesce(max(seq), 0) + 1, %s, %s, %s"
                    " FROM onceflow.restatements WHERE job = %s RETURNING seq",
                    (self.job, window_id, request_id, epoch, self.job),
                ).fetchone()
            conn.commit()
        assert row is not None
        return int(row[0])

    def restatement_completed(self, seq: int) -> bool:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT completed_at IS NOT NULL FROM onceflow.restatements"
                " WHERE job = %s AND seq = %s",
                (self.job, seq),
            ).fetchone()
        return bool(row and row[0])

    def pending_restatements(self) -> list[tuple[int, int, str]]:
        """Restatements planned but not finished: (seq, window id, request id)."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT seq, window_id, request_id FROM onceflow.restatements"
                " WHERE job = %s AND completed_at IS NULL ORDER BY seq",
                (self.job,),
            ).fetchall()
        return [(int(s), int(w), str(r)) for s, w, r in rows]

    def complete_restatement(self, seq: int) -> None:
        with self.connect() as conn:
            conn.execute(
                "UPDATE onceflow.restatements SET completed_at = now() WHERE job = %s AND seq = %s",
                (self.job, seq),
            )
            conn.commit()
