"""Maintenance of a job's Delta sinks keeps the guarantee: compaction is no change to a
downstream reader, vacuum keeps every file a lagging downstream job needs (and says which job
and version held it), orphan files go under the job's fence, and no file a kept version holds
is ever removed.

Real Delta tables and a real PostgreSQL ledger; the upstream job's windows are committed
through the sink's own commit protocol (no Spark: the files are written by pyarrow, as the
executors' writers do), the downstream job's windows planned in its ledger.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame

from onceflow import DeltaSink, Job, ParquetSource, Settings, ops
from onceflow._identifiers import epoch_app_id
from onceflow.job import WindowContext
from onceflow.ledger import Ledger
from onceflow.sinks.contract import SinkOutcome
from onceflow.sinks.delta._files import add_actions
from onceflow.sinks.delta._log import data_files, relative
from onceflow.sinks.delta.table import DeltaTableSink
from onceflow.sources.delta import DeltaTableSource
from onceflow.storage import Location

SCHEMA = {"event_id": "string", "points": "bigint"}


def _same(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return {"out": rows}


UP = Job(
    name="maint_up",
    source=ParquetSource("events", schema=SCHEMA),
    transform=_same,
    sinks=(DeltaSink("maint_up_events", "out", table="up"),),
    deterministic=True,
)
DOWN = Job(
    name="maint_down",
    source=DeltaTableSource("up"),
    transform=_same,
    sinks=(DeltaSink("maint_down_events", "out", table="down"),),
    deterministic=True,
)


@pytest.fixture()
def settings(tmp_path: Path, pg_dsn: str, lake: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)


def _commit_window(settings: Settings, dsn: str, index: int) -> int:
    """Land one Parquet file and commit it as the upstream job's next window, through the
    Delta sink's commit protocol; return the table version holding it."""
    folder = settings.landing.path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    rows = pa.table({"event_id": [f"e{index}-{i}" for i in range(3)], "points": [1, 2, 3]})
    pq.write_table(rows, folder / f".f{index}.tmp")
    (folder / f".f{index}.tmp").rename(folder / f"f{index:04d}.parquet")

    ledger = Ledger(dsn, UP.name)
    ledger.ensure_schema()
    epoch = ledger.acquire_epoch(f"test-{uuid.uuid4().hex}")
    units = ledger.unplanned(UP.source.discover(settings))
    offsets = UP.source.offsets(settings, units)
    window = ledger.plan_window(epoch, offsets, units)

    sink = DeltaTableSink(UP.name, "maint_up_events", settings.lake / "up")
    data = rows.append_column("_window_id", pa.array([window.window_id] * 3, pa.int64()))
    sink.ensure_table(data.schema)
    sub = f"w{window.window_id:010d}-e{epoch}-{uuid.uuid4().hex[:8]}"
    (settings.lake.path / "up" / sub).mkdir()
    pq.write_table(data, settings.lake.path / "up" / sub / "part-0.parquet")
    stat = (settings.lake.path / "up" / sub / "part-0.parquet").stat()
    adds = add_actions(
        [
            {
                "path": f"{sub}/part-0.parquet",
                "size": stat.st_size,
                "modified_ms": int(stat.st_mtime * 1000),
                "rows": 3,
            }
        ]
    )
    done = sink.commit_files(
        adds, window_id=window.window_id, epoch=epoch, run_id="t", offsets=offsets
    )
    assert done.version is not None
    ledger.mark_completed(
        window.window_id,
        commits=[SinkOutcome("maint_up_events", True, False, data_version=done.version)],
    )
    return done.version


def _downstream_reads(settings: Settings, dsn: str, start: int, end: int) -> None:
    """The downstream job plans (and completes) a window over versions start..end."""
    ledger = Ledger(dsn, DOWN.name)
    ledger.ensure_schema()
    epoch = ledger.acquire_epoch(f"test-{uuid.uuid4().hex}")
    units = [u for u in DOWN.source.discover(settings) if start <= int(u) <= end]
    window = ledger.plan_window(epoch, DOWN.source.offsets(settings, units), units)
    ledger.mark_completed(window.window_id)


def _short_retention(path: Path) -> None:
    DeltaTable(str(path)).alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 0 seconds"}
    )


def _referenced_by_kept_versions(path: Path, keep: int) -> set[str]:
    """Every file any version from `keep` to the newest holds (each version loaded)."""
    table = Location.parse(str(path))
    latest = DeltaTable(str(path)).version()
    out: set[str] = set()
    for version in range(max(keep, 0), latest + 1):
        snapshot = DeltaTable(str(path), version=version)
        for file in snapshot.get_add_actions(flatten=True).column("path").to_pylist():
            rel = relative(table, file)
            assert rel is not None
            out.add(rel)
    return out


def _on_disk(path: Path) -> set[str]:
    return {rel for rel, _, _ in data_files(Location.parse(str(path)))}


def test_vacuum_keeps_what_a_lagging_downstream_job_needs(settings: Settings, pg_dsn: str) -> None:
    path = settings.lake.path / "up"
    versions = [_commit_window(settings, pg_dsn, i) for i in range(5)]
    _short_retention(path)
    # The downstream job has read the first two windows' versions only.
    _downstream_reads(settings, pg_dsn, 0, versions[1])

    result = ops.maintain(UP, settings, dsn=pg_dsn, jobs=[UP, DOWN], orphan_age_s=0)
    (table,) = result.tables
    assert table.compacted_files == 5 and table.compaction_version is not None
    assert table.live_files_after == 1
    # Held back at the version the downstream job read through, and the result says so.
    assert table.keep_version == versions[1]
    assert [(h.job, h.version) for h in table.binding] == [("maint_down", versions[1])]
    text = "\n".join(result.lines())
    assert "maint_down" in text and f"through version {versions[1]}" in text, text
    assert table.files_vacuumed == 0 and table.fenced_epoch is None
    # Every file a kept version holds is on disk, and the downstream job can read on: the
    # compaction commit is no change to it (its actions carry dataChange=false).
    assert _referenced_by_kept_versions(path, table.keep_version) <= _on_disk(path)
    latest = DeltaTable(str(path)).version()
    rest = DOWN.source.offsets(
        settings, [u for u in DOWN.source.discover(settings) if int(u) > versions[1]]
    )
    assert DOWN.source.check_available(settings, rest) == []
    compaction = DOWN.source._plan(settings, {**rest, "start": table.compaction_version})
    assert compaction.files == [] and not compaction.problems

    # Once the downstream job has read on, the small files go.
    _downstream_reads(settings, pg_dsn, versions[1] + 1, latest)
    again = ops.maintain(UP, settings, dsn=pg_dsn, jobs=[UP, DOWN], orphan_age_s=0)
    (table,) = again.tables
    assert table.binding == () and table.keep_version == DeltaTable(str(path)).version()
    assert table.files_vacuumed == 5 and table.files_after == 1
    assert _referenced_by_kept_versions(path, table.keep_version) <= _on_disk(path)
    rows = DeltaTable(str(path)).to_pyarrow_table(columns=["event_id"]).column(0).to_pylist()
    assert sorted(rows) == sorted(f"e{i}-{j}" for i in range(5) for j in range(3))


def test_a_dry_run_changes_nothing(settings: Settings, pg_dsn: str) -> None:
    path = settings.lake.path / "up"
    for i in range(3):
        _commit_window(settings, pg_dsn, i)
    _short_retention(path)
    before = (
        DeltaTable(str(path)).version(),
        _on_disk(path),
        sorted(os.listdir(path / "_delta_log")),
    )
    result = ops.maintain(UP, settings, dsn=pg_dsn, jobs=[UP, DOWN], dry_run=True)
    (table,) = result.tables
    assert table.compacted_files == 3 and result.as_json()["dry_run"] is True
    after = (
        DeltaTable(str(path)).version(),
        _on_disk(path),
        sorted(os.listdir(path / "_delta_log")),
    )
    assert after == before
    # The downstream job has read nothing: it holds every version.
    assert [(h.job, h.version) for h in table.held_by] == [("maint_down", -1)]


def test_orphans_go_under_the_fence_and_no_referenced_file_is_removed(
    settings: Settings, pg_dsn: str
) -> None:
    path = settings.lake.path / "up"
    for i in range(3):
        _commit_window(settings, pg_dsn, i)
    _short_retention(path)
    # A commit that lost its race and was killed before removing its files, an hour ago; and
    # one written just now (it may be a commit in flight).
    old = path / f"w{9:010d}-e1-{uuid.uuid4().hex[:8]}"
    new = path / f"w{9:010d}-e2-{uuid.uuid4().hex[:8]}"
    for folder in (old, new):
        folder.mkdir()
        pq.write_table(pa.table({"event_id": ["x"], "points": [1]}), folder / "part-0.parquet")
    hour_ago = time.time() - 3600
    os.utime(old / "part-0.parquet", (hour_ago, hour_ago))
    epoch_before = Ledger(pg_dsn, UP.name).current_epoch() or 0

    result = ops.maintain(UP, settings, dsn=pg_dsn, jobs=[UP], orphan_age_s=600)
    (table,) = result.tables
    assert table.orphans_removed == 1
    assert not (old / "part-0.parquet").exists() and (new / "part-0.parquet").exists()
    # Taken as a run takes it: a new epoch in the ledger, claimed in the table.
    assert table.fenced_epoch is not None and table.fenced_epoch > epoch_before
    assert Ledger(pg_dsn, UP.name).current_epoch() == table.fenced_epoch
    claimed = DeltaTable(str(path)).transaction_version(epoch_app_id(UP.name, "maint_up_events"))
    assert claimed == table.fenced_epoch
    assert _referenced_by_kept_versions(path, table.keep_version) <= _on_disk(path)
    # The job's sink still holds exactly its windows' rows.
    rows = DeltaTable(str(path)).to_pyarrow_table(columns=["event_id"]).column(0).to_pylist()
    assert sorted(rows) == sorted(f"e{i}-{j}" for i in range(3) for j in range(3))


def test_a_window_commit_racing_compaction_decides_again(settings: Settings, pg_dsn: str) -> None:
    """A window committed on a snapshot taken before the compaction committed loses its race
    (max_commit_retries=0), decides again on the new snapshot and lands once."""
    path = settings.lake.path / "up"
    for i in range(3):
        _commit_window(settings, pg_dsn, i)
    sink = DeltaTableSink(UP.name, "maint_up_events", settings.lake / "up")
    real_table = sink.table
    raced: list[int] = []

    def table_then_compact() -> DeltaTable:
        snapshot = real_table()
        if not raced:  # the window's first snapshot: the compaction commits right after it
            raced.append(snapshot.version())
            ops.maintain(UP, settings, dsn=pg_dsn, jobs=[UP], orphan_age_s=3600)
        return snapshot

    sink.table = table_then_compact  # type: ignore[method-assign]
    # The next window, committed through this sink object.
    folder = settings.landing.path / "events"
    pq.write_table(pa.table({"event_id": ["late-0"], "points": [5]}), folder / "f9999.parquet")
    ledger = Ledger(pg_dsn, UP.name)
    epoch = ledger.acquire_epoch("race")
    sink.claim_epoch(epoch)
    units = ledger.unplanned(UP.source.discover(settings))
    offsets = UP.source.offsets(settings, units)
    window = ledger.plan_window(epoch, offsets, units)
    sub = f"w{window.window_id:010d}-e{epoch}-race"
    (path / sub).mkdir()
    data = pa.table(
        {
            "event_id": ["late-0"],
            "points": [5],
            "_window_id": pa.array([window.window_id], pa.int64()),
        }
    )
    pq.write_table(data, path / sub / "part-0.parquet")
    stat = (path / sub / "part-0.parquet").stat()
    adds = add_actions(
        [{"path": f"{sub}/part-0.parquet", "size": stat.st_size, "modified_ms": 0, "rows": 1}]
    )
    done = sink.commit_files(
        adds, window_id=window.window_id, epoch=epoch, run_id="race", offsets=offsets
    )
    assert raced and done.version is not None and done.version > raced[0] + 1
    rows = DeltaTable(str(path)).to_pyarrow_table(columns=["event_id"]).column(0).to_pylist()
    assert sorted(rows) == sorted([f"e{i}-{j}" for i in range(3) for j in range(3)] + ["late-0"])
    history = DeltaTable(str(path)).history()
    assert any(h.get("onceflow.maintain") == "compact" for h in history)


def test_the_cli_prints_the_result_as_json(pg_dsn: str, tmp_path: Path, lake: Path) -> None:
    """`onceflow maintain` finds the job and its readers in the registry (here the reference
    jobs: daily_totals reads payments' table)."""
    import json

    from onceflow.generate import generate_payments
    from tests.support.cli import CliRun, cli_env

    landing = tmp_path / "landing"
    generate_payments(landing, records=20, files=1, seed=3)
    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    lake_path = lake / "payments"
    lake_path.mkdir()
    pa_rows = pa.table({"payment_id": ["p1"], "_window_id": pa.array([1], pa.int64())})
    sink = DeltaTableSink("payments", "lake_payments", Location.parse(str(lake_path)))
    sink.ensure_table(pa_rows.schema)
    done = CliRun(["maintain", "payments", "--dry-run", "--json"], env, home / "logs").finish()
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["operation"] == "maintain" and result["dry_run"] is True
    (table,) = result["tables"]
    assert table["sink"] == "lake_payments"
    assert [h["job"] for h in table["held_by"]] == ["daily_totals"]
