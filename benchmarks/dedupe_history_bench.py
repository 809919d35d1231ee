"""Benchmark: a window's dedupe cost as history grows (10k, 1M, 10M keys), new path vs old.

New: the key index (`onceflow._keyindex`): the window's keys looked up by primary key on the
executors (`SeenLookup`), then its kept keys added in one transaction. Old: an anti-join of the
window's keys with every key of the Delta state table, which reads the whole history. The
history is written directly (the index by `generate_series`, the Delta table by
`write_deltalake`), then one 20,000-key window (5% of them already seen) is deduplicated,
`--repeat` times; the median is printed with its ratio to the smallest history, with the peak
memory of this driver and of its Spark JVM while the window's repeats ran (the history stays in
PostgreSQL: neither should grow with it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from payments_bench import MemorySampler

JOB = "bench"


def fill_index(dsn: str, have: int, want: int) -> None:
    """Add keys `have+1 … want` to the index, 20,000 per window."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
            " SELECT %s, 'p-' || g, g / 20000 + 1 FROM generate_series(%s::bigint, %s::bigint) AS g",
            (JOB, have + 1, want),
        )
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE onceflow.dedupe_keys")


def fill_delta(path: Path, have: int, want: int) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    step = 1_000_000
    for start in range(have + 1, want + 1, step):
        stop = min(want, start + step - 1)
        ids = pa.array([f"p-{g}" for g in range(start, stop + 1)], pa.string())
        windows = pa.array([g // 20000 + 1 for g in range(start, stop + 1)], pa.int64())
        write_deltalake(
            str(path), pa.table({"payment_id": ids, "_window_id": windows}), mode="append"
        )


def window_frame(spark: Any, history: int, rows: int) -> Any:
    """A window's valid rows: 5% keys from the history, the rest new."""
    seen = max(1, rows // 20)
    keys = [f"p-{1 + (i * 7919) % history}" for i in range(seen)]
    keys += [f"n-{uuid.uuid4().hex}" for _ in range(rows - seen)]
    return spark.createDataFrame(
        [(k, None) for k in keys], "payment_id STRING, _reason STRING"
    ).repartition(2)


def new_path(spark: Any, dsn: str, frame: Any, window_id: int) -> tuple[float, int]:
    """Look up the window's keys, then add its kept keys to the index (rolled back)."""
    from onceflow._keyindex import KeyIndex
    from onceflow._keylookup import KEY_COL, SEEN_COL
    from onceflow.ledger import Ledger
    from onceflow.sinks.writers import rows_written, run_writers

    index = KeyIndex(dsn, JOB, Ledger(dsn, JOB))
    lookup = index.lookup(("payment_id",), window_id)
    started = time.perf_counter()
    marked = frame.mapInArrow(lookup, lookup.struct(frame.schema)).cache()
    kept = marked.where(~marked[SEEN_COL]).selectExpr(KEY_COL, f"{window_id} AS window_id")
    writer = index.staging_writer("keys", window_id, "bench")
    rows = rows_written(run_writers({"keys": kept}, [writer]).written[writer.key])
    with psycopg.connect(dsn) as conn:
        assert index.add(conn, writer.table, [window_id], rows)
        conn.rollback()  # keep the history as it is for the next repeat
    elapsed = time.perf_counter() - started
    index.drop_staging(writer.table)
    duplicates = marked.count() - rows
    marked.unpersist()
    return elapsed, duplicates


def old_path(spark: Any, path: Path, frame: Any) -> tuple[float, int]:
    """The anti-join of the window's keys with the whole Delta state (the engine before)."""
    from deltalake import DeltaTable
    from pyspark.sql import functions as F

    from onceflow._delta_read import read_snapshot

    started = time.perf_counter()
    state = read_snapshot(spark, DeltaTable(str(path)), str(path))
    seen = state.groupBy("payment_id").agg(F.min("_window_id").alias("__seen_in"))
    kept = frame.join(seen, "payment_id", "left_anti").count()
    elapsed = time.perf_counter() - started
    return elapsed, frame.count() - kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,1000000,10000000")
    parser.add_argument("--old-sizes", default="10000,1000000", help="'' to skip the old path")
    parser.add_argument("--window", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    old_sizes = {int(s) for s in args.old_sizes.split(",") if s}

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow._keyindex import DDL
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-dedupe-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE SCHEMA IF NOT EXISTS onceflow")
            conn.execute(DDL)
            conn.commit()
        spark = build_spark_session(app_name="onceflow-dedupe-bench")
        rows: list[tuple[int, float, float | None, int]] = []
        memory: list[tuple[float, float]] = []
        have_index = have_delta = 0
        for size in sizes:
            t0 = time.perf_counter()
            fill_index(dsn, have_index, size)
            have_index = size
            print(f"history {size:,}: index filled in {time.perf_counter() - t0:.1f}s", flush=True)
            if size in old_sizes:
                fill_delta(work / "state", have_delta, size)
                have_delta = size
            window_id = size // 20000 + 2
            new_times, old_times = [], []
            duplicates = 0
            with MemorySampler() as mem:
                for _ in range(args.repeat + 1):  # the first is a warm-up
                    frame = window_frame(spark, size, args.window)
                    elapsed, duplicates = new_path(spark, dsn, frame, window_id)
                    new_times.append(elapsed)
                    if size in old_sizes:
                        old_times.append(old_path(spark, work / "state", frame)[0])
            memory.append((mem.driver_peak / 2**20, mem.jvm_peak / 2**20))
            new = statistics.median(new_times[1:])
            old = statistics.median(old_times[1:]) if old_times else None
            rows.append((size, new, old, duplicates))
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base_new = rows[0][1]
    base_old = rows[0][2]
    print(
        f"\nmachine: {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f}; window "
        f"{args.window:,} keys (5% seen before), median of {args.repeat}\n"
    )
    print(
        f"{'history keys':>14} {'key index s':>12} {'vs smallest':>12} {'old anti-join s':>16}"
        f" {'driver MB':>10} {'JVM MB':>8}"
    )
    for (size, new, old, duplicates), (driver_mb, jvm_mb) in zip(rows, memory, strict=True):
        old_text = f"{old:>16.3f}" if old is not None else f"{'-':>16}"
        print(
            f"{size:>14,} {new:>12.3f} {new / base_new:>11.2f}x {old_text}"
            f" {driver_mb:>10.0f} {jvm_mb:>8.0f}"
        )
        assert duplicates == max(1, args.window // 20), duplicates
    if base_old is not None:
        last_old = [r for r in rows if r[2] is not None][-1]
        print(f"\nold path at {last_old[0]:,}: {last_old[2] / base_old:.2f}x its smallest history")
    return 0


if __name__ == "__main__":
    sys.exit(main())
