"""The ledger's schema: created once, and brought up to date on a ledger made by an older
onceflow (windows could not be skipped then)."""

from __future__ import annotations

import psycopg

from onceflow.ledger import Ledger

OLD_WINDOWS = """
CREATE SCHEMA onceflow;
CREATE TABLE onceflow.windows (
    job text NOT NULL, window_id bigint NOT NULL, offsets jsonb NOT NULL, epoch bigint NOT NULL,
    planned_at timestamptz NOT NULL DEFAULT now(), stats jsonb, completed_at timestamptz,
    PRIMARY KEY (job, window_id));
INSERT INTO onceflow.windows (job, window_id, offsets, epoch) VALUES ('payments', 1, '{}', 1);
"""


def _columns(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = 'onceflow' AND table_name = 'windows'"
        ).fetchall()
    return {r[0] for r in rows}


def test_an_older_ledger_gets_the_skip_columns_and_keeps_its_windows(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(OLD_WINDOWS)
    assert "skip_reason" not in _columns(pg_dsn)
    ledger = Ledger(pg_dsn, "payments")
    ledger.ensure_schema()
    ledger.ensure_schema()  # idempotent
    assert {"skipped_at", "skip_reason"} <= _columns(pg_dsn)
    [window] = ledger.windows(pending_only=True)
    assert window.window_id == 1 and window.skipped is None


def test_a_skipped_window_is_no_longer_pending(pg_dsn: str) -> None:
    ledger = Ledger(pg_dsn, "payments")
    ledger.ensure_schema()
    epoch = ledger.acquire_epoch("run-1")
    first = ledger.plan_window(epoch, {"files": ["a"]}, ["a"])
    second = ledger.plan_window(epoch, {"files": ["b"]}, ["b"])
    ledger.skip_window(epoch, first.window_id, "gone")
    assert [w.window_id for w in ledger.windows(pending_only=True)] == [second.window_id]
    skipped = ledger.window(first.window_id)
    assert skipped is not None and skipped.skipped == "gone" and not skipped.completed
    ledger.skip_window(epoch, first.window_id, "another reason")  # the first reason stays
    assert ledger.window(first.window_id).skipped == "gone"  # type: ignore[union-attr]


def test_the_ledger_creates_no_sink_kinds_tables_and_records_any_kinds_commit(
    pg_dsn: str,
) -> None:
    """The PostgreSQL markers' tables are the PostgreSQL group's to create, not the ledger's
    (nor lineage's); the ledger records each sink commit as one generic row, whatever the kind,
    and an older ledger that recorded only Delta versions gets the generic columns."""
    from onceflow.sinks.contract import SinkOutcome

    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "CREATE SCHEMA onceflow; CREATE TABLE onceflow.sink_versions (job text NOT NULL,"
            " window_id bigint NOT NULL, sink text NOT NULL, version bigint NOT NULL,"
            " restate_seq bigint, recorded_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (job, window_id, sink))"
        )
    ledger = Ledger(pg_dsn, "payments")
    ledger.ensure_schema()
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            "SELECT to_regclass('onceflow.sink_commits'), to_regclass('onceflow.restate_commits')"
        ).fetchone()
    assert found == (None, None)
    epoch = ledger.acquire_epoch("run-1")
    window = ledger.plan_window(epoch, {"files": ["a"]}, ["a"])
    commits = [
        SinkOutcome("lake", True, False, rows=3, data_version=7),
        SinkOutcome("pg_a", True, False, rows=3, commit_ref="812"),
        SinkOutcome("pg_b", True, False, rows=1, commit_ref="812"),
    ]
    ledger.mark_completed(window.window_id, commits=commits)
    ledger.mark_completed(window.window_id, commits=commits)  # idempotent
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT sink, version, commit_ref, rows_written FROM onceflow.sink_versions"
            " WHERE job = 'payments' AND window_id = %s ORDER BY sink",
            (window.window_id,),
        ).fetchall()
        [lineage] = conn.execute(
            "SELECT data_versions, commit_refs, rows_committed FROM onceflow.lineage"
            " WHERE job = 'payments' AND window_id = %s",
            (window.window_id,),
        ).fetchall()
    assert rows == [("lake", 7, None, 3), ("pg_a", None, "812", 3), ("pg_b", None, "812", 1)]
    assert lineage == (
        {"lake": 7},
        {"pg_a": "812", "pg_b": "812"},
        {"lake": 3, "pg_a": 3, "pg_b": 1},
    )
