"""The ledger's verified point (`onceflow/_ledger_verified.py`): removals are noted by the
server, a start-up consumes exactly the notes it read, and a table emptied or created again
voids the point."""

from __future__ import annotations

import psycopg

from onceflow import _ledger_verified as verified_point
from onceflow.ledger import Ledger

JOB = "verified_job"


def _ledger(dsn: str, windows: int) -> Ledger:
    ledger = Ledger(dsn, JOB)
    ledger.ensure_schema()
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch)"
            " SELECT %s, i, '{}'::jsonb, 1 FROM generate_series(1, %s) AS i",
            (JOB, windows),
        )
        conn.execute(
            "INSERT INTO onceflow.source_units (job, unit, window_id)"
            " SELECT %s, 'u' || i, i FROM generate_series(1, %s) AS i",
            (JOB, windows),
        )
    return ledger


def _run(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(statement)


def test_a_removal_noted_while_a_start_up_checks_is_left_for_the_next(pg_dsn: str) -> None:
    ledger = _ledger(pg_dsn, 10)
    point, notes = verified_point.read(ledger)
    assert point is None and notes.ids == ()  # nothing verified yet: everything is checked
    verified_point.record(ledger, 1, 10, notes)
    point, notes = verified_point.read(ledger)
    assert point == verified_point.Verified(10, frozenset())

    _run(pg_dsn, f"DELETE FROM onceflow.source_units WHERE job = '{JOB}' AND window_id = 3")
    point, notes = verified_point.read(ledger)
    assert point is not None and point.removed == {3}
    # Rows removed after the notes were read and before the point is recorded: not consumed.
    _run(pg_dsn, f"DELETE FROM onceflow.windows WHERE job = '{JOB}' AND window_id = 7")
    verified_point.record(ledger, 1, 10, notes)
    point, _ = verified_point.read(ledger)
    assert point is not None and point.removed == {7}


def test_another_jobs_removals_are_its_own(pg_dsn: str) -> None:
    ledger = _ledger(pg_dsn, 5)
    verified_point.record(ledger, 1, 5, verified_point.read(ledger)[1])
    _run(pg_dsn, "INSERT INTO onceflow.source_units VALUES ('other', 'x', 1)")
    _run(pg_dsn, "DELETE FROM onceflow.source_units WHERE job = 'other'")
    point, notes = verified_point.read(ledger)
    assert point == verified_point.Verified(5, frozenset()) and notes.ids == ()


def test_a_truncation_or_a_table_created_again_voids_the_point(pg_dsn: str) -> None:
    ledger = _ledger(pg_dsn, 5)
    verified_point.record(ledger, 1, 5, verified_point.read(ledger)[1])
    _run(pg_dsn, "TRUNCATE onceflow.source_units")
    point, notes = verified_point.read(ledger)
    assert point is None and len(notes.truncations) == 1
    verified_point.record(ledger, 1, 5, notes)  # checked whole: the truncation is seen
    assert verified_point.read(ledger)[0] == verified_point.Verified(5, frozenset())

    _run(pg_dsn, "DROP TABLE onceflow.ledger_removals CASCADE")
    ledger.ensure_schema()
    assert verified_point.read(ledger)[0] is None  # the notes' table is new: check whole
