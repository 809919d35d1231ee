"""Benchmark: an incremental reconcile on a history of many windows, against the same on 100.

For each history size a job that dedupes by a key into one Delta sink gets that many completed
windows, built quickly: one landed Parquet file per window (20 rows, keys unique), the
ledger's `windows` and `source_units` rows and the key index (`dedupe_keys`, `dedupe_windows`)
by `generate_series` inserts, and the Delta log by writing one commit entry per window directly
(its own data file, with the column statistics delta-rs writes, the window's app transaction
and offsets) and a checkpoint at the end. The sink is recorded as reconciled through the
second-to-last window, as a scheduled incremental reconcile leaves it, and then, on one Spark
session, times (median of `--repeat`) `reconcile(mode="incremental")` in repair mode (a new
epoch, the lacking-windows replay check, the last window recomputed and compared, nothing to
repair) and, up to `--full-max` windows (100), a full reconcile once. Every timed reconcile must
find the sink clean, or the benchmark fails. With `--maintained`, each history is first
maintained as a job on its maintenance schedule is (`ops.maintain`: files compacted, the log
cleaned), the steady state.

    .venv/bin/python benchmarks/reconcile_bench.py --sizes 100,10000,100000 [--maintained]
        [--quality] [--runs]

`--quality` also times the job's quality suites on each history (the Spark aggregate apart
from the rest), `--runs` a run of one new window on it (start-up, the key index's first look,
the window's compute and commit), after the reconciles: with every committed file still in the
landing folder, then with them removed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from deltalake import DeltaTable
from maintain_bench import _database  # a database of its own for each history
from pyspark.sql import DataFrame, SparkSession

from onceflow import DeltaSink, Job, ParquetSource, Settings, ops
from onceflow._identifiers import delta_app_id, epoch_app_id
from onceflow.engine import Engine
from onceflow.job import Dedupe, WindowContext
from onceflow.ledger import Ledger
from onceflow.reconcile import format_report, reconcile
from onceflow.sinks.delta.table import DeltaTableSink

ROWS = 20
SINK = "bench_lake"


def _same(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return {"out": rows.select("event_id", "points", ctx.window_id_column().alias("_window_id"))}


JOB = Job(
    name="bench_reconcile",
    source=ParquetSource("events", schema={"event_id": "string", "points": "bigint"}),
    transform=_same,
    sinks=(DeltaSink(SINK, "out", table="events"),),
    dedupe=Dedupe(key=("event_id",), state_sink=SINK),
    deterministic=True,
)


def _rows(wid: int) -> pa.Table:
    return pa.table(
        {
            "event_id": [f"{wid:08d}-{j:02d}" for j in range(ROWS)],
            "points": pa.array(range(ROWS), pa.int64()),
        }
    )


def build_history(settings: Settings, dsn: str, windows: int) -> None:
    """`windows` completed windows: landed files, ledger, key index and the Delta log."""
    folder = settings.landing.path / "events"
    folder.mkdir(parents=True)
    sizes, mtimes = [], []
    for wid in range(1, windows + 1):
        path = folder / f"f{wid:08d}.parquet"
        pq.write_table(_rows(wid), path)
        sizes.append(path.stat().st_size)
        mtimes.append(path.stat().st_mtime_ns)
    ledger = Ledger(dsn, JOB.name)
    ledger.ensure_schema()
    Engine(JOB, settings, None, dsn).prepare()  # the key index's tables
    epoch = ledger.acquire_epoch("bench-build")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, completed_at, stats)"
            " SELECT %s, i, jsonb_build_object('files', jsonb_build_array("
            "   'events/f' || lpad(i::text, 8, '0') || '.parquet'),"
            "   'sizes', jsonb_build_array((%s::bigint[])[i]),"
            "   'mtimes', jsonb_build_array((%s::bigint[])[i])),"
            " %s, now(), jsonb_build_object('outputs', jsonb_build_object('out', %s::bigint))"
            " FROM generate_series(1, %s) AS i",
            (JOB.name, sizes, mtimes, epoch, ROWS, windows),
        )
        conn.execute(
            "INSERT INTO onceflow.source_units (job, unit, window_id)"
            " SELECT %s, 'events/f' || lpad(i::text, 8, '0') || '.parquet', i"
            " FROM generate_series(1, %s) AS i",
            (JOB.name, windows),
        )
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
            " SELECT %s, lpad(i::text, 8, '0') || '-' || lpad(j::text, 2, '0'), i"
            " FROM generate_series(1, %s) AS i, generate_series(0, %s) AS j",
            (JOB.name, windows, ROWS - 1),
        )
        conn.execute(
            "INSERT INTO onceflow.dedupe_windows (job, window_id, keys)"
            " SELECT %s, i, %s FROM generate_series(1, %s) AS i",
            (JOB.name, ROWS, windows),
        )
        # As a scheduled incremental reconcile leaves it: verified through the window before.
        conn.execute(
            "INSERT INTO onceflow.reconciliations (job, sink, verified_through)"
            " VALUES (%s, %s, %s)",
            (JOB.name, SINK, windows - 1),
        )
    sink = DeltaTableSink(JOB.name, SINK, settings.lake / "events")
    schema = _rows(1).append_column("_window_id", pa.array([1] * ROWS, pa.int64())).schema
    sink.ensure_table(schema)
    table_path = settings.lake.path / "events"
    app, epoch_app = delta_app_id(JOB.name, SINK), epoch_app_id(JOB.name, SINK)
    now_ms = int(time.time() * 1000)
    for wid in range(1, windows + 1):
        data = _rows(wid).append_column("_window_id", pa.array([wid] * ROWS, pa.int64()))
        rel = f"w{wid:010d}-e{epoch}/part-0.parquet"
        (table_path / rel).parent.mkdir()
        pq.write_table(data, table_path / rel)
        ids = data.column("event_id").to_pylist()
        stats = {
            "numRecords": ROWS,
            "minValues": {"event_id": min(ids), "points": 0, "_window_id": wid},
            "maxValues": {"event_id": max(ids), "points": ROWS - 1, "_window_id": wid},
            "nullCount": {"event_id": 0, "points": 0, "_window_id": 0},
        }
        offsets = {
            "files": [f"events/f{wid:08d}.parquet"],
            "sizes": [sizes[wid - 1]],
            "mtimes": [mtimes[wid - 1]],
        }
        entry = [
            {
                "commitInfo": {
                    "timestamp": now_ms,
                    "operation": "WRITE",
                    "onceflow.job": JOB.name,
                    "onceflow.sink": SINK,
                    "onceflow.window_id": str(wid),
                    "onceflow.epoch": str(epoch),
                    "onceflow.offsets": json.dumps(offsets),
                    "onceflow.rows": str(ROWS),
                }
            },
            {"txn": {"appId": app, "version": wid, "lastUpdated": now_ms}},
            {"txn": {"appId": epoch_app, "version": epoch, "lastUpdated": now_ms}},
            {
                "add": {
                    "path": rel,
                    "size": (table_path / rel).stat().st_size,
                    "partitionValues": {},
                    "modificationTime": now_ms,
                    "dataChange": True,
                    "stats": json.dumps(stats),
                }
            },
        ]
        (table_path / "_delta_log" / f"{wid:020d}.json").write_text(
            "\n".join(json.dumps(a) for a in entry) + "\n"
        )
    DeltaTable(str(table_path)).create_checkpoint()


def bench(
    server: str,
    work: Path,
    spark: SparkSession,
    windows: int,
    repeat: int,
    full: bool,
    maintained: bool = False,
    quality: bool = False,
    window_runs: bool = False,
    profile: Path | None = None,
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
    if maintained:
        # The steady state of a job maintained on its schedule (as maintain_bench.py makes it):
        # the small files compacted, the log cleaned, its commit records kept beside it.
        started = time.perf_counter()
        path = settings.lake.path / "events"
        ops.maintain(JOB, settings, dsn=dsn, jobs=[JOB])
        DeltaTable(str(path)).alter.set_table_properties(
            {"delta.logRetentionDuration": "interval 0 seconds"}
        )
        ops.maintain(JOB, settings, dsn=dsn, jobs=[JOB])
        DeltaTable(str(path)).alter.set_table_properties(
            {"delta.logRetentionDuration": "interval 30 days"}
        )
        out["maintain_s"] = time.perf_counter() - started
    engine = Engine(JOB, settings, spark, dsn)
    times = []
    for _ in range(repeat):
        with psycopg.connect(dsn) as conn:  # each time as the schedule's last run left it
            conn.execute(
                "UPDATE onceflow.reconciliations SET verified_through = %s WHERE job = %s",
                (windows - 1, JOB.name),
            )
        report = reconcile(engine, mode="incremental")
        assert report.clean and report.windows_recomputed == 1, format_report(report)
        times.append(report.wall_s)
    out["incremental_s"] = statistics.median(times)
    if quality:
        # The job's quality suites on the same history: the whole table's aggregate on Spark
        # (it grows with the table's rows) and everything else (the ledger's expected counts,
        # the snapshot, GE), which must not grow with the window count.
        walls, sparks = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            checked = ops.validate(JOB, settings, spark=spark, dsn=dsn)
            walls.append(time.perf_counter() - started)
            assert checked.passed, [r for r in checked.report.results if not r.passed]
            sparks.append(sum(v for k, v in checked.report.timings.items() if k.endswith(":spark")))
        out["validate_s"] = statistics.median(walls)
        out["validate_spark_s"] = statistics.median(sparks)
        out["validate_rest_s"] = statistics.median(
            w - s for w, s in zip(walls, sparks, strict=True)
        )
    if window_runs:
        # A run of one new window on the history (start-up, the key index's first look, plan,
        # compute, commit), a new landed file each time; after the reconciles: they expect
        # the history as it was built.
        folder = settings.landing.path / "events"
        runs = []
        runner = Engine(JOB, settings, spark, dsn)
        for i in range(repeat + 1):
            wid = windows + 1 + i
            pq.write_table(_rows(wid), folder / f".f{wid:08d}.tmp")
            (folder / f".f{wid:08d}.tmp").rename(folder / f"f{wid:08d}.parquet")
            started = time.perf_counter()
            result = runner.run(max_units_per_window=1)
            if i:  # the first warms the run's code paths
                runs.append(time.perf_counter() - started)
            assert len(result.windows) == 1, result
        out["window_run_s"] = statistics.median(runs)
        # The same once the history's files are gone from the landing folder, as a producer
        # that cleans up committed input leaves it: what the window count alone costs.
        for path in folder.glob("f*.parquet"):
            if int(path.stem[1:]) <= windows:
                path.unlink()
        runs = []
        profiler = cProfile.Profile() if profile else None
        for i in range(repeat):
            wid = windows + repeat + 2 + i
            pq.write_table(_rows(wid), folder / f".f{wid:08d}.tmp")
            (folder / f".f{wid:08d}.tmp").rename(folder / f"f{wid:08d}.parquet")
            started = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            result = runner.run(max_units_per_window=1)
            if profiler is not None:
                profiler.disable()
            runs.append(time.perf_counter() - started)
            assert len(result.windows) == 1, result
        if profiler is not None and profile is not None:
            profiler.dump_stats(str(profile / f"run_cleaned_{windows}.prof"))
        out["window_run_cleaned_s"] = statistics.median(runs)
    if full:
        report = reconcile(engine)
        assert report.clean and report.windows_recomputed == windows, format_report(report)
        out["full_s"] = report.wall_s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--full-max", type=int, default=100, help="time a full reconcile up to this size"
    )
    parser.add_argument(
        "--maintained",
        action="store_true",
        help="run `onceflow maintain` on each history before timing (the scheduled steady state)",
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="also time the job's quality suites (validate) on each history",
    )
    parser.add_argument(
        "--runs",
        action="store_true",
        help="also time a run of one new window on each history",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="with --runs: write a cProfile of the runs on cleaned input here (one file a size)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-reconcile-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        server = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        spark = build_spark_session(app_name="onceflow-reconcile-bench")
        # One untimed reconcile first: the session's first queries compile and load classes.
        bench(server, work / "warm", spark, 10, 1, False)
        results = {}
        for size in [int(s) for s in args.sizes.split(",") if s]:
            results[size] = bench(
                server,
                work,
                spark,
                size,
                args.repeat,
                size <= args.full_max,
                args.maintained,
                args.quality,
                args.runs,
                args.profile,
            )
            print(size, {k: round(v, 3) for k, v in results[size].items()}, flush=True)
        base = results[min(results)]
        print(f"\n{'windows':>8} {'build':>8} {'incremental':>12} {'ratio':>6} {'full':>8}")
        for size, r in results.items():
            full = f"{r['full_s']:>7.1f}s" if "full_s" in r else "(not run)"
            print(
                f"{size:>8} {r['build_s']:>7.1f}s {r['incremental_s']:>11.2f}s "
                f"{r['incremental_s'] / base['incremental_s']:>5.2f}x {full:>8}"
            )
        if args.runs:
            print(
                f"\n{'windows':>8} {'one window run':>15} {'ratio':>6}"
                f" {'input cleaned up':>17} {'ratio':>6}"
            )
            for size, r in results.items():
                print(
                    f"{size:>8} {r['window_run_s']:>14.2f}s "
                    f"{r['window_run_s'] / base['window_run_s']:>5.2f}x"
                    f" {r['window_run_cleaned_s']:>16.2f}s "
                    f"{r['window_run_cleaned_s'] / base['window_run_cleaned_s']:>5.2f}x"
                )
        if args.quality:
            print(f"\n{'windows':>8} {'validate':>9} {'spark':>7} {'rest':>7} {'rest ratio':>10}")
            for size, r in results.items():
                print(
                    f"{size:>8} {r['validate_s']:>8.2f}s {r['validate_spark_s']:>6.2f}s "
                    f"{r['validate_rest_s']:>6.2f}s "
                    f"{r['validate_rest_s'] / base['validate_rest_s']:>9.2f}x"
                )
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
