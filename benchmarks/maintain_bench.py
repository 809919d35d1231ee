"""Benchmark: what a year of windows costs, and what `onceflow maintain` gives back.

For each history size (100, 10,000, optionally 100,000 windows) a job with one Delta sink gets
that many completed windows, built quickly: the ledger's `windows` and `source_units` rows by
one `generate_series` insert, the Delta log by writing one commit entry per window directly
(each adding one small Parquet file, with the window's app transaction and offsets, as the
sink's commit writes them) and a checkpoint at the end, as delta-rs's commits write one every
100 versions. Then, without Spark, it times (median of `--repeat`):

- start-up of a writing run (`JobContext.start`: ledger rebuild from the sinks, retention
  check, new epoch claimed in the table, the ledger's self-check),
- `onceflow status` (`ops.status`),
- the lacking-windows check (`Engine.lacking_windows`),

each with its ratio to the smallest history, before and after `ops.maintain` (after: the steady
state of a job maintained on its schedule, every window past the log retention: the log cleaned,
its commit records kept beside it); and the Delta table's data file count and a full
snapshot read (`DeltaTable.to_pyarrow_table`) before and after `ops.maintain`, against the same
rows written in one commit. With `--window` (Spark), also a run of one new window on each
maintained history (start-up to completed). An incremental reconcile is not timed here.

    .venv/bin/python benchmarks/maintain_bench.py --sizes 100,10000,100000 --maintain-max 10000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from deltalake import DeltaTable, write_deltalake
from pyspark.sql import DataFrame, SparkSession

from onceflow import DeltaSink, Job, ParquetSource, Settings, ops
from onceflow._identifiers import delta_app_id, epoch_app_id
from onceflow.engine import Engine
from onceflow.job import WindowContext
from onceflow.ledger import Ledger
from onceflow.sinks.delta.table import DeltaTableSink

ROWS_PER_WINDOW = 20


def _same(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return {"out": rows}


JOB = Job(
    name="bench_events",
    source=ParquetSource("events", schema={"event_id": "string", "points": "bigint"}),
    transform=_same,
    sinks=(DeltaSink("bench_events_lake", "out", table="events"),),
    deterministic=True,
)


def _database(server: str) -> str:
    name = f"b_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


def build_history(settings: Settings, dsn: str, windows: int) -> None:
    """`windows` completed windows in the ledger and in the Delta table's log."""
    ledger = Ledger(dsn, JOB.name)
    ledger.ensure_schema()
    epoch = ledger.acquire_epoch("bench-build")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, planned_at,"
            " completed_at)"
            " SELECT %s, i, jsonb_build_object('files', jsonb_build_array("
            "   'events/f' || lpad(i::text, 7, '0') || '.parquet'),"
            "   'sizes', jsonb_build_array(700), 'mtimes', jsonb_build_array(0)),"
            " %s, now(), now() FROM generate_series(1, %s) AS i",
            (JOB.name, epoch, windows),
        )
        conn.execute(
            "INSERT INTO onceflow.source_units (job, unit, window_id)"
            " SELECT %s, 'events/f' || lpad(i::text, 7, '0') || '.parquet', i"
            " FROM generate_series(1, %s) AS i",
            (JOB.name, windows),
        )
    path = settings.lake.path / "events"
    data = pa.table(
        {
            "event_id": [f"e{i}" for i in range(ROWS_PER_WINDOW)],
            "points": pa.array(range(ROWS_PER_WINDOW), pa.int64()),
            "_window_id": pa.array([1] * ROWS_PER_WINDOW, pa.int64()),
        }
    )
    sink = DeltaTableSink(JOB.name, "bench_events_lake", settings.lake / "events")
    sink.ensure_table(data.schema)
    template = path / "template.parquet"
    pq.write_table(data, template)
    size = template.stat().st_size
    app, epoch_app = (
        delta_app_id(JOB.name, "bench_events_lake"),
        epoch_app_id(JOB.name, "bench_events_lake"),
    )
    stats = json.dumps({"numRecords": ROWS_PER_WINDOW})
    now_ms = int(time.time() * 1000)
    for wid in range(1, windows + 1):
        rel = f"w{wid:010d}-e{epoch}/part-0.parquet"
        (path / rel).parent.mkdir()
        if wid % 60_000 == 0:  # a file system allows about 65,000 links to one file
            shutil.copyfile(template, path / "copy.parquet")
            (path / "copy.parquet").replace(template)
        os.link(template, path / rel)  # one file each, built fast: the bytes are not read
        offsets = {"files": [f"events/f{wid:07d}.parquet"], "sizes": [700], "mtimes": [0]}
        entry = [
            {
                "commitInfo": {
                    "timestamp": now_ms,
                    "operation": "WRITE",
                    "onceflow.job": JOB.name,
                    "onceflow.sink": "bench_events_lake",
                    "onceflow.window_id": str(wid),
                    "onceflow.epoch": str(epoch),
                    "onceflow.offsets": json.dumps(offsets),
                    "onceflow.rows": str(ROWS_PER_WINDOW),
                }
            },
            {"txn": {"appId": app, "version": wid, "lastUpdated": now_ms}},
            {"txn": {"appId": epoch_app, "version": epoch, "lastUpdated": now_ms}},
            {
                "add": {
                    "path": rel,
                    "size": size,
                    "partitionValues": {},
                    "modificationTime": now_ms,
                    "dataChange": True,
                    "stats": stats,
                }
            },
        ]
        (path / "_delta_log" / f"{wid:020d}.json").write_text(
            "\n".join(json.dumps(a) for a in entry) + "\n"
        )
    template.unlink()
    table = DeltaTable(str(path))
    table.alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 seconds"})
    # The sink's commits go through delta-rs, whose post-commit hook writes a checkpoint every
    # `delta.checkpointInterval` (100) versions: a table loads from its newest checkpoint.
    DeltaTable(str(path)).create_checkpoint()


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _read(path: Path) -> tuple[float, int]:
    started = time.perf_counter()
    rows = DeltaTable(str(path)).to_pyarrow_table().num_rows
    return time.perf_counter() - started, rows


def _data_files(path: Path) -> int:
    return sum(1 for p in path.rglob("*.parquet") if "_delta_log" not in p.parts)


def bench(
    server: str,
    work: Path,
    windows: int,
    repeat: int,
    maintain: bool = True,
    spark: SparkSession | None = None,
) -> dict[str, float]:
    root = work / f"h{windows}"
    settings = Settings(
        home=root / "home", postgres_dsn=None, lake=root / "lake", landing=root / "landing"
    )
    settings.check_folders()
    dsn = _database(server)
    started = time.perf_counter()
    build_history(settings, dsn, windows)
    out: dict[str, float] = {"build_s": time.perf_counter() - started}
    engine = Engine(JOB, settings, None, dsn)
    out["startup_s"] = _median(lambda: engine.start(f"bench-{uuid.uuid4().hex}"), repeat)
    out["status_s"] = _median(lambda: ops.status(JOB, settings, dsn=dsn), repeat)
    out["lacking_s"] = _median(engine.lacking_windows, repeat)
    path = settings.lake.path / "events"
    out["files_before"] = _data_files(path)
    out["read_before_s"], rows = _read(path)
    out["rows"] = rows
    if not maintain:
        return out
    # The steady state of a job maintained on its schedule: every window older than the
    # table's log retention (here all of them), so the log is cleaned too. `maintain` keeps
    # the entries' commit records beside the log first; the property's own commit then cleans
    # the log below the newest checkpoint (delta-rs's post-commit hook), and `maintain` again.
    # Every window is past the detail horizon too (`keep_detail_days=0`): the ledger's detail
    # dropped, the windows' plans folded.
    started = time.perf_counter()
    ops.maintain(JOB, settings, dsn=dsn, jobs=[JOB], keep_detail_days=0)
    DeltaTable(str(path)).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 0 seconds"}
    )
    ops.maintain(JOB, settings, dsn=dsn, jobs=[JOB], keep_detail_days=0)
    out["maintain_s"] = time.perf_counter() - started
    out["files_after"] = _data_files(path)
    out["log_entries_after"] = len(list((path / "_delta_log").glob("*.json")))
    out["read_after_s"] = statistics.median(_read(path)[0] for _ in range(repeat))
    once = root / "once"
    write_deltalake(str(once), DeltaTable(str(path)).to_pyarrow_table())
    out["read_one_commit_s"] = statistics.median(_read(once)[0] for _ in range(repeat))
    # The steady state of a job maintained on its schedule: the same three after `maintain`.
    out["startup_after_s"] = _median(lambda: engine.start(f"bench-{uuid.uuid4().hex}"), repeat)
    out["status_after_s"] = _median(lambda: ops.status(JOB, settings, dsn=dsn), repeat)
    out["lacking_after_s"] = _median(engine.lacking_windows, repeat)
    if spark is not None:
        out["window_after_s"] = _window_runs(spark, settings, dsn, repeat)
    return out


def _window_runs(spark: SparkSession, settings: Settings, dsn: str, repeat: int) -> float:
    """A run of one new window on top of the history (a landed file, `Engine.run`: start-up,
    plan, compute, commit, complete), after one untimed run that warms the session up."""
    # Back to the default log retention: the windows these runs commit are copied beside the
    # log only by the next `maintain`, and until then a start-up (rightly) refuses a retention
    # shorter than their age.
    DeltaTable(str(settings.lake.path / "events")).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 30 days"}
    )
    runner = Engine(JOB, settings, spark, dsn)
    folder = settings.landing.path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    times = []
    for i in range(repeat + 1):
        data = pa.table(
            {
                "event_id": [f"n{i}-{j}" for j in range(ROWS_PER_WINDOW)],
                "points": pa.array(range(ROWS_PER_WINDOW), pa.int64()),
            }
        )
        pq.write_table(data, folder / f".n{i}.tmp")
        (folder / f".n{i}.tmp").rename(folder / f"n{i:04d}.parquet")
        started = time.perf_counter()
        result = runner.run(max_units_per_window=1)
        if i:
            times.append(time.perf_counter() - started)
        assert len(result.windows) == 1, result
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--maintain-max",
        type=int,
        default=10_000,
        help="run and time `maintain` only for histories up to this many windows",
    )
    parser.add_argument(
        "--window",
        action="store_true",
        help="also time a run of one new window on each maintained history (starts Spark)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    work = Path(tempfile.mkdtemp(prefix="onceflow-maintain-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        server = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        spark = None
        if args.window:
            from onceflow.spark import build_spark_session

            spark = build_spark_session(app_name="onceflow-maintain-bench")
        results = {}
        for size in [int(s) for s in args.sizes.split(",") if s]:
            results[size] = bench(server, work, size, args.repeat, size <= args.maintain_max, spark)
            print(size, {k: round(v, 4) for k, v in results[size].items()}, flush=True)
        base = results[min(results)]
        print(
            f"\n{'windows':>8} {'build':>7} {'start-up':>9} {'status':>8} {'lacking':>8} "
            f"{'files':>7} {'read':>7} {'maintain':>9} {'files':>6} {'read':>7} {'1 commit':>8}"
        )
        for size, r in results.items():
            kept = "maintain_s" in r
            print(
                f"{size:>8} {r['build_s']:>6.1f}s {r['startup_s']:>8.3f}s {r['status_s']:>7.3f}s "
                f"{r['lacking_s']:>7.3f}s {int(r['files_before']):>7} {r['read_before_s']:>6.3f}s "
                + (
                    f"{r['maintain_s']:>8.2f}s {int(r['files_after']):>6} "
                    f"{r['read_after_s']:>6.3f}s {r['read_one_commit_s']:>7.3f}s"
                    if kept
                    else "(maintain not run)"
                )
            )
        for size, r in results.items():
            print(
                f"{size:>8} ratios to {min(results)}: start-up "
                f"{r['startup_s'] / base['startup_s']:.2f}x, status "
                f"{r['status_s'] / base['status_s']:.2f}x, lacking "
                f"{r['lacking_s'] / base['lacking_s']:.2f}x"
                + (
                    f"; read after maintain / one commit "
                    f"{r['read_after_s'] / r['read_one_commit_s']:.2f}x"
                    if "maintain_s" in r
                    else ""
                )
            )
        kept = {size: r for size, r in results.items() if "maintain_s" in r}
        if len(kept) > 1:
            first = kept[min(kept)]
            print("\nafter `maintain` (the steady state of a job maintained on its schedule):")
            for size, r in kept.items():
                print(
                    f"{size:>8} start-up {r['startup_after_s']:.3f}s "
                    f"({r['startup_after_s'] / first['startup_after_s']:.2f}x), status "
                    f"{r['status_after_s']:.3f}s ({r['status_after_s'] / first['status_after_s']:.2f}x), "
                    f"lacking {r['lacking_after_s']:.3f}s "
                    f"({r['lacking_after_s'] / first['lacking_after_s']:.2f}x)"
                    + (
                        f", one new window's run {r['window_after_s']:.3f}s "
                        f"({r['window_after_s'] / first['window_after_s']:.2f}x)"
                        if "window_after_s" in r
                        else ""
                    )
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
