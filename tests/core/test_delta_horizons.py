"""Horizons: what a Delta table forgets (log entries cleaned at a checkpoint, app transactions
past their retention) never makes a run plan old input again.

A Delta-only job's windows are recorded only in its table's commit entries. After a checkpoint
and log cleanup removed the oldest ones and the ledger was lost, a run must refuse (naming the
fix) rather than plan the forgotten windows' input again under new window ids; the fix it names
(start the job over into a new table) must then give every record once. The start-up guard
refuses retentions shorter than the job's horizon, before anything is lost.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import ConfigurationError, DeltaSink, Engine, Job, ParquetSource, Settings, ops
from onceflow.errors import LedgerError
from onceflow.job import WindowContext

SCHEMA = {"event_id": "string", "team": "string", "points": "bigint"}
TABLE = "events"


def _events(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return {
        "events": rows.select(
            "event_id", "team", "points", F.lit(ctx.window_id).cast("bigint").alias("_window_id")
        )
    }


JOB = Job(
    name="lake_events",
    source=ParquetSource("events", schema=SCHEMA),
    transform=_events,
    sinks=(DeltaSink("lake_events", "events", table=TABLE),),
    deterministic=True,
)


def _land(landing: Path, index: int) -> list[str]:
    """One Parquet file of three events, ids unique across files."""
    ids = [f"f{index}-e{i}" for i in range(3)]
    folder = landing / "events"
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"event_id": ids, "team": ["red"] * 3, "points": pa.array([1, 2, 3], pa.int64())}
    )
    pq.write_table(table, folder / f".b{index}.tmp")
    (folder / f".b{index}.tmp").rename(folder / f"b{index}.parquet")
    return ids


def _lost_and_doubled(lake: Path, landed: list[str]) -> tuple[int, int]:
    rows = DeltaTable(str(lake / TABLE)).to_pyarrow_table(columns=["event_id"])
    got = Counter(rows.column("event_id").to_pylist())
    want = Counter(landed)
    return sum((want - got).values()), sum((got - want).values())


def _clean_log(path: Path) -> None:
    """What a checkpoint with a short `delta.logRetentionDuration` does: a checkpoint, then every
    older commit entry removed (delta-rs's own cleanup, as its post-commit hook runs it)."""
    table = DeltaTable(str(path))
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 1 seconds"})
    table = DeltaTable(str(path))
    table.create_checkpoint()
    old = time.time() - 3600
    for entry in (path / "_delta_log").glob("*.json"):
        os.utime(entry, (old, old))
    table.cleanup_metadata()
    # The property back to its default, so only the cleanup above is under test.
    DeltaTable(str(path)).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 30 days"}
    )


def _windows_in_log(path: Path) -> list[int]:
    return sorted(
        int(e["onceflow.window_id"])
        for e in DeltaTable(str(path)).history()
        if "onceflow.window_id" in e
    )


def test_a_cleaned_log_and_a_lost_ledger_refuse_rather_than_double(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    path = lake / TABLE
    landed = _land(landing, 0) + _land(landing, 1)
    first = Engine(JOB, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in first.windows] == [1, 2]

    # The log is checkpointed and cleaned: windows 1 and 2 are no longer in it, and the
    # table's app transaction (kept by the checkpoint) still says it holds them.
    _clean_log(path)
    assert not (path / "_delta_log" / f"{0:020d}.json").exists()
    assert _windows_in_log(path) == []
    landed += _land(landing, 2) + _land(landing, 3)
    second = Engine(JOB, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in second.windows] == [3, 4]
    assert _windows_in_log(path) == [3, 4]
    assert _lost_and_doubled(lake, landed) == (0, 0)

    # The ledger is lost, and more input lands.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP SCHEMA onceflow CASCADE")
    landed += _land(landing, 4)
    before = DeltaTable(str(path)).version()

    with pytest.raises(LedgerError) as refused:
        Engine(JOB, settings, spark, pg_dsn).run(max_units_per_window=1)
    message = str(refused.value)
    assert "lake_events" in message and "windows 1-2" in message, message
    assert "logRetentionDuration" in message and "backup" in message, message
    assert "move its Delta tables away" in message, message
    # Nothing was written: the three files of windows 1-2 were not planned again.
    assert DeltaTable(str(path)).version() == before
    assert _lost_and_doubled(lake, landed) == (3, 0)  # only the new file is not in yet

    # The fix it names: start the job over into a new table.
    shutil.move(str(path), str(tmp_path / "events-old"))
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP SCHEMA onceflow CASCADE")
    again = Engine(JOB, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert [w.window_id for w in again.windows] == [1, 2, 3]
    assert _lost_and_doubled(lake, landed) == (0, 0)


def test_the_guard_covers_log_retention_and_transactions(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    path = lake / TABLE
    _land(landing, 0)
    engine = Engine(JOB, settings, spark, pg_dsn)
    engine.run()
    group = engine.groups[0]

    def age_windows(days: int) -> None:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "UPDATE onceflow.windows SET planned_at = now() - make_interval(days => %s)",
                (days,),
            )

    def oldest() -> datetime:
        with psycopg.connect(pg_dsn) as conn:
            return conn.execute("SELECT min(planned_at) FROM onceflow.windows").fetchone()[0]

    def properties(values: dict[str, str]) -> None:
        DeltaTable(str(path)).alter.set_table_properties(values)

    # Young windows: the default log retention (30 days) is longer than the horizon.
    engine.check_retention()
    # 40 days: past it, and the job's only sink is Delta, so a lost ledger could not be rebuilt.
    age_windows(40)
    with pytest.raises(ConfigurationError, match=r"logRetentionDuration.*\(the default\)"):
        engine.check_retention()
    # A PostgreSQL sink beside it would keep every window's record: the log is not needed.
    group.check_retention(oldest(), records_elsewhere=True)
    properties({"delta.logRetentionDuration": "interval 3650 days"})
    engine.check_retention()
    properties({"delta.logRetentionDuration": "interval 1 days"})
    with pytest.raises(ConfigurationError, match="logRetentionDuration = 'interval 1 days',"):
        engine.check_retention()
    properties({"delta.enableExpiredLogCleanup": "false"})  # entries are then never removed
    engine.check_retention()

    # Application transactions: a retention shorter than the horizon is refused as before.
    properties({"delta.setTransactionRetentionDuration": "interval 1 weeks"})
    with pytest.raises(ConfigurationError, match="setTransactionRetentionDuration"):
        engine.check_retention()
    properties({"delta.setTransactionRetentionDuration": "interval 60 days"})
    engine.check_retention()
    # A run starts through the same guard.
    properties({"delta.enableExpiredLogCleanup": "true"})
    _land(landing, 1)
    with pytest.raises(ConfigurationError, match="logRetentionDuration"):
        engine.run()


def test_maintain_keeps_the_records_a_cleaned_log_loses(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """`onceflow maintain` cleans a Delta-only job's log once the entries' records are kept
    beside it: a lost ledger is rebuilt from them, and no input is planned again."""
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    path = lake / TABLE
    landed = _land(landing, 0) + _land(landing, 1) + _land(landing, 2)
    engine = Engine(JOB, settings, spark, pg_dsn)
    assert [w.window_id for w in engine.run(max_units_per_window=1).windows] == [1, 2, 3]

    # Every retention past: maintenance checkpoints and cleans the whole log below.
    DeltaTable(str(path)).alter.set_table_properties(
        {
            "delta.logRetentionDuration": "interval 0 seconds",
            "delta.deletedFileRetentionDuration": "interval 0 seconds",
        }
    )
    result = ops.maintain(JOB, settings, dsn=pg_dsn, jobs=[JOB])
    (table,) = result.tables
    assert table.log_entries_removed > 0, table
    assert not (path / "_delta_log" / f"{0:020d}.json").exists()
    assert _windows_in_log(path) == []  # the log names none of the three windows
    assert list((path / "_onceflow" / "log_records").glob("*.jsonl.gzip"))
    DeltaTable(str(path)).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 30 days"}
    )

    # The records answer for the removed entries: windows above 1 from the kept records...
    group = engine.groups[0]
    assert [r.window_id for r in group.recorded_windows(after=1)] == [2, 3]
    # ...and the start-up guard no longer counts windows whose records are kept, however old.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE onceflow.windows SET planned_at = now() - interval '40 days'")
    engine.check_retention()

    # The ledger is lost and more input lands: the three windows come back from the records
    # (completed by this run, which finds them held), their input is not planned again, and
    # the new file is the fourth window.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP SCHEMA onceflow CASCADE")
    landed += _land(landing, 3)
    version = DeltaTable(str(path)).version()
    again = Engine(JOB, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in again.windows] == [1, 2, 3, 4]
    assert _lost_and_doubled(lake, landed) == (0, 0)
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT window_id, offsets->'files' FROM onceflow.windows WHERE job = %s"
            " ORDER BY window_id",
            (JOB.name,),
        ).fetchall()
    assert [(w, [f.rsplit("/", 1)[-1] for f in files]) for w, files in rows] == [
        (i + 1, [f"b{i}.parquet"]) for i in range(4)
    ]
    # One window commit (the fourth) after the run's epoch claim: nothing written twice.
    windows = [
        e.get("onceflow.window_id")
        for e in DeltaTable(str(path)).history()
        if int(e["version"]) > version
    ]
    assert [w for w in windows if w is not None] == ["4"]
