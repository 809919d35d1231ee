"""The PostgreSQL sinks' held floor (`onceflow.sinks.postgres._held`): a passed start-up check
lets the next one ask only about newer windows, and never past a marker removed, a table
replaced or markers folded.

The payments job: the `lake_payments` Delta sink, the `pg_payments`, `pg_merchant_balances`
and quarantine PostgreSQL sinks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.engine import Engine
from onceflow.errors import SinkStateError
from onceflow.generate import generate_payments
from onceflow.registry import get_job
from onceflow.settings import Settings
from onceflow.sinks.postgres import PostgresGroup
from tests.support.oracle import expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact

JOB = "payments"


def _floor(engine: Engine) -> int:
    (group,) = [g for g in engine.groups if isinstance(g, PostgresGroup)]
    return group.held_floor()


@pytest.fixture()
def settings(tmp_path: Path, pg_dsn: str, lake: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)


def test_the_floor_rises_with_each_passed_check_and_holds_through_a_fold(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    job = get_job(JOB)
    generate_payments(landing, records=600, files=3, duplicate_rate=0.1, invalid_rate=0.1, seed=21)
    engine = Engine(job, settings, spark, pg_dsn)
    engine.prepare()
    assert _floor(engine) == 0
    engine.run(max_units_per_window=1)  # windows 1-3; its start-up had none to check
    assert _floor(engine) == 0
    generate_payments(landing, records=200, files=1, seed=22)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # checked 1-3, then 4
    assert _floor(engine) == 3
    assert engine.lacking_windows() == {}

    # Folding the markers moves them, and counts them the same: the floor stays.
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM onceflow.sink_commits WHERE job = %s", (JOB,)
        ).fetchone()
    assert left == (0,)
    assert _floor(engine) == 3
    generate_payments(landing, records=200, files=1, seed=23)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # checked 4, then 5
    assert _floor(engine) == 4
    files = visible_files(landing)
    assert_exact(
        expected_outputs(landing, windows=[[f] for f in files]), actual_outputs(pg_dsn, lake)
    )


@pytest.mark.parametrize("removed", ["marker", "folded"])
def test_a_marker_removed_below_the_floor_is_found_by_the_next_run(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, removed: str
) -> None:
    """A marker of window 2 removed by hand (or the folded row holding it): the floor no
    longer holds, and the next run asks about every window and refuses, naming the fix."""
    job = get_job(JOB)
    generate_payments(landing, records=600, files=3, duplicate_rate=0.1, invalid_rate=0.1, seed=24)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    generate_payments(landing, records=200, files=1, seed=25)
    engine = Engine(job, settings, spark, pg_dsn)
    engine.run(max_units_per_window=1)
    assert _floor(engine) == 3
    with psycopg.connect(pg_dsn) as conn:
        if removed == "marker":
            conn.execute(
                "DELETE FROM onceflow.sink_commits"
                " WHERE job = %s AND sink = 'pg_payments' AND window_id = 2",
                (JOB,),
            )
        else:
            ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
            conn.execute(
                "DELETE FROM onceflow.sink_commits_folded WHERE job = %s AND sink = 'pg_payments'",
                (JOB,),
            )
    assert _floor(engine) == 0
    generate_payments(landing, records=200, files=1, seed=26)
    with pytest.raises(
        SinkStateError, match=r"pg_payments lacks windows 2\b|pg_payments lacks windows 1"
    ):
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)


def test_a_replaced_table_drops_the_floor(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path
) -> None:
    job = get_job(JOB)
    generate_payments(landing, records=400, files=2, duplicate_rate=0.1, invalid_rate=0.1, seed=27)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    generate_payments(landing, records=200, files=1, seed=28)
    engine = Engine(job, settings, spark, pg_dsn)
    engine.run(max_units_per_window=1)
    assert _floor(engine) == 2
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP TABLE public.merchant_balances")
    engine = Engine(job, settings, spark, pg_dsn)
    engine.prepare()  # creates the table again: another table, whose markers do not hold
    assert _floor(engine) == 0
    assert engine.lacking_windows() == {"pg_merchant_balances": [1, 2, 3]}
