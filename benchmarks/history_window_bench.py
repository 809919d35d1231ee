"""Benchmark: whole `payments` windows as history grows (10k, 1M, 10M payments before them).

`dedupe_history_bench.py` times the key index alone; this one times what a user waits for: runs
of `payments` windows (exactly_once, 20,000 payments a window, every sink). Each history size
has a database and lake of its own, with its history written directly where its size matters:
the dedupe key index and the PostgreSQL `payments` table (its primary key) each get that many
rows, under the first window's id, by `generate_series`. The Delta table only gains files a
window, whatever its size, and the balances table has one row per merchant and currency, so
neither is grown.

Then, `--rounds` times, each size in turn (the order rotating from round to round, so no size
is always first or last) gets `--windows` new windows (4 files of 5,000 payments each, 5%
repeats and 1% invalid lines, as `payments_bench.py`), processed in one run. Printed per size:
the median window latency (plan → committed in every sink, and → completed; over each run's
windows after its first two, which plan the run's two slots), the median run's wall time a
window, and the peak memory of this driver and of its Spark JVM during its runs, each time
with its ratio to the smallest history. Every database has one warm-up run first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from payments_bench import MemorySampler
from peer_pipeline import fresh_database

FILES_PER_WINDOW = 4
RECORDS_PER_FILE = 5_000


@dataclass
class Sized:
    history: int
    engine: Any
    landing: Path
    visible: list[float] = field(default_factory=list)
    completed: list[float] = field(default_factory=list)
    wall_per_window: list[float] = field(default_factory=list)
    driver_mb: float = 0.0
    jvm_mb: float = 0.0


def grow_history(dsn: str, size: int) -> None:
    """Add `size` payments of history to the key index and to the `payments` table."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
            " SELECT 'payments', 'h-' || g, 1 FROM generate_series(1, %s::bigint) AS g",
            (size,),
        )
        conn.execute(
            "INSERT INTO public.payments (payment_id, merchant_id, customer_id, amount_cents,"
            " currency, created_at, _window_id, _source_file, _source_line)"
            " SELECT 'h-' || g, 'm-' || (g %% 5000), 'c-' || (g %% 100000), 100 + g %% 9000, 'USD',"
            " timestamptz '2024-01-01' + g * interval '1 second', 1, 'history', g"
            " FROM generate_series(1, %s::bigint) AS g",
            (size,),
        )
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE onceflow.dedupe_keys")
        conn.execute("VACUUM ANALYZE public.payments")
        # The bulk load's dirty pages written now, not by checkpoints during the timed windows:
        # a real history was written over months.
        conn.execute("CHECKPOINT")


def land(landing: Path, windows: int, seed: int) -> None:
    """Land `windows` windows of new payments."""
    from onceflow.generate import generate_payments

    files = windows * FILES_PER_WINDOW
    generate_payments(
        landing,
        records=files * RECORDS_PER_FILE,
        files=files,
        duplicate_rate=0.05,
        invalid_rate=0.01,
        seed=seed,
    )


def run_windows(engine: Any, windows: int) -> tuple[list[Any], float]:
    """Process the landed windows in one run."""
    started = time.perf_counter()
    result = engine.run(max_units_per_window=FILES_PER_WINDOW)
    elapsed = time.perf_counter() - started
    if len(result.windows) != windows:
        raise RuntimeError(f"expected {windows} windows, the run processed {len(result.windows)}")
    return result.windows, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,1000000,10000000")
    parser.add_argument("--windows", type=int, default=8, help="windows a run")
    parser.add_argument("--rounds", type=int, default=3, help="runs a size")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.engine import build_engine
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.settings import Settings
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-history-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    out: list[Sized] = []
    try:
        server_dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        spark = build_spark_session(app_name="onceflow-history-bench")
        for size in sizes:
            dsn = fresh_database(server_dsn, "bench_history")
            landing = work / f"landing-{size}"
            settings = Settings(
                home=work / "home", postgres_dsn=dsn, lake=work / f"lake-{size}", landing=landing
            )
            engine = build_engine(PAYMENTS, settings, spark, dsn, guarantee="exactly_once")
            engine.prepare()
            land(landing, 2, seed=1)
            run_windows(engine, 2)  # warm-up; leaves the tables created
            t0 = time.perf_counter()
            grow_history(dsn, size)
            print(f"history {size:,}: written in {time.perf_counter() - t0:.1f} s", flush=True)
            out.append(Sized(size, engine, landing))
        for r in range(args.rounds):
            for sized in out[r % len(out) :] + out[: r % len(out)]:
                land(sized.landing, args.windows, seed=10 + r)  # not in the run's memory
                with MemorySampler() as mem:
                    windows, elapsed = run_windows(sized.engine, args.windows)
                steady = windows[2:] or windows
                sized.visible += [w.visible_s for w in steady]
                sized.completed += [w.latency_s for w in steady]
                sized.wall_per_window.append(elapsed / len(windows))
                sized.driver_mb = max(sized.driver_mb, mem.driver_peak / 2**20)
                sized.jvm_mb = max(sized.jvm_mb, mem.jvm_peak / 2**20)
                print(f"round {r + 1}, history {sized.history:,}: {elapsed:.1f} s", flush=True)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nmachine: {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f}; "
        f"{args.rounds} runs a size of {args.windows} windows of "
        f"{FILES_PER_WINDOW * RECORDS_PER_FILE:,} payments, exactly_once, every sink\n"
    )
    print(
        f"{'history':>12} {'p50 visible s':>16} {'p50 completed s':>16} {'wall/window s':>16}"
        f" {'driver MB':>10} {'JVM MB':>8}"
    )
    base = out[0]

    def cell(values: list[float], smallest: list[float]) -> str:
        value, first = statistics.median(values), statistics.median(smallest)
        return f"{f'{value:.3f} ({value / first:.2f}x)':>16}"

    for s in out:
        print(
            f"{s.history:>12,} {cell(s.visible, base.visible)}"
            f" {cell(s.completed, base.completed)}"
            f" {cell(s.wall_per_window, base.wall_per_window)}"
            f" {s.driver_mb:>10.0f} {s.jvm_mb:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
