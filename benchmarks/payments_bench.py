"""Benchmark: `onceflow run payments` against the plain pipeline a user would write instead.

One invocation, one input, one window size: onceflow exactly_once, onceflow at_least_once and
the peer (`peer_pipeline.py`: Structured Streaming, `maxFilesPerTrigger`, `foreachBatch` into
Delta and PostgreSQL, at-least-once) each read the same generated landing files on the same
Spark session and PostgreSQL server; optionally plain COPY and `write_deltalake` of the rows
onceflow wrote. Prints wall times and their ratios, window latency and driver memory; then
(`--paced`) the latency of windows that arrive one at a time, in a follow run.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from peer_pipeline import COLUMNS, fresh_database, run_peer

PAYMENT_DDL = """
CREATE TABLE payments_copy (
    payment_id text PRIMARY KEY, merchant_id text NOT NULL, customer_id text NOT NULL,
    amount_cents bigint NOT NULL, currency text NOT NULL, created_at timestamptz NOT NULL,
    _window_id bigint NOT NULL, _source_file text NOT NULL, _source_line bigint NOT NULL
)
"""


@dataclass
class Measurement:
    name: str
    rows: int
    seconds: float
    windows: int = 0
    window_latency: list[float] = field(default_factory=list)
    window_visible: list[float] = field(default_factory=list)
    sink_latency: dict[str, list[float]] = field(default_factory=dict)
    driver_peak_mb: float = 0.0
    driver_growth_mb: float = 0.0  # peak over the driver's RSS when the run started
    jvm_peak_mb: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


class MemorySampler:
    """Peak RSS of this Python driver and of its Spark JVM (java children), sampled in a thread."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.driver_peak = 0
        self.jvm_peak = 0
        self._stop = threading.Event()
        self._me = psutil.Process()
        # What an earlier run left allocated (the peer's collected batches) is not this run's.
        self.driver_start = self._me.memory_info().rss
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _jvm_rss(self) -> int:
        total = 0
        for child in self._me.children(recursive=True):
            try:
                if "java" in child.name():
                    total += child.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.driver_peak = max(self.driver_peak, self._me.memory_info().rss)
            self.jvm_peak = max(self.jvm_peak, self._jvm_rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def driver_growth(self) -> int:
        return max(0, self.driver_peak - self.driver_start)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): the ceil(q% * n)-th smallest value."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def run_engine(
    spark: Any,
    server_dsn: str,
    work: Path,
    landing: Path,
    guarantee: str,
    label: str,
    files_per_window: int = 1,
) -> tuple[Measurement, Path]:
    from onceflow.engine import build_engine
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.settings import Settings

    dsn = fresh_database(server_dsn, f"bench_{guarantee}")
    lake = work / f"lake-{label}-{uuid.uuid4().hex[:6]}"
    settings = Settings(home=work / "home", postgres_dsn=dsn, lake=lake, landing=landing)
    engine = build_engine(PAYMENTS, settings, spark, dsn, guarantee=guarantee)
    engine.prepare()
    with MemorySampler() as mem:
        started = time.perf_counter()
        result = engine.run(max_units_per_window=files_per_window)
        elapsed = time.perf_counter() - started
    m = Measurement(
        label,
        rows=sum(int((w.stats or {}).get("kept", 0)) for w in result.windows),
        seconds=elapsed,
        windows=len(result.windows),
        window_latency=[w.latency_s for w in result.windows],
        window_visible=[w.visible_s for w in result.windows],
        driver_peak_mb=mem.driver_peak / 2**20,
        driver_growth_mb=mem.driver_growth / 2**20,
        jvm_peak_mb=mem.jvm_peak / 2**20,
    )
    for w in result.windows:
        for name, outcome in w.sinks.items():
            m.sink_latency.setdefault(name, []).append(outcome.latency_s)
    return m, lake


@dataclass
class Paced:
    """Windows of a follow run fed one window's files at a time (`interval_s` apart)."""

    interval_s: float
    plan_to_completed: list[float] = field(default_factory=list)
    plan_to_visible: list[float] = field(default_factory=list)
    land_to_completed: list[float] = field(default_factory=list)
    rows: int = 0


def run_paced(
    spark: Any,
    server_dsn: str,
    work: Path,
    landing: Path,
    files_per_window: int,
    interval_s: float,
) -> Paced:
    """`onceflow run payments --follow` (exactly_once) while the landing files arrive one
    window's worth every `interval_s`, slower than a window commits, so no window waits for or
    overlaps another: the latency of a window alone, from its plan and from its last file
    landing (a 50 ms poll included)."""
    from onceflow.engine import build_engine
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.settings import Settings

    files = sorted(p.relative_to(landing) for p in landing.rglob("*") if p.is_file())
    fed = work / f"paced-landing-{uuid.uuid4().hex[:6]}"
    spool = work / f"paced-spool-{uuid.uuid4().hex[:6]}"
    for rel in files:
        (fed / rel).parent.mkdir(parents=True, exist_ok=True)
        (spool / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(landing / rel, spool / rel)
    dsn = fresh_database(server_dsn, "bench_paced")
    settings = Settings(
        home=work / "home", postgres_dsn=dsn, lake=work / f"lake-{fed.name}", landing=fed
    )
    engine = build_engine(PAYMENTS, settings, spark, dsn, guarantee="exactly_once")
    engine.prepare()
    out = Paced(interval_s)
    landed: dict[str, float] = {}
    committed: set[str] = set()
    stop = threading.Event()

    def feed() -> None:
        for start in range(0, len(files), files_per_window):
            batch = files[start : start + files_per_window]
            for rel in batch:  # a rename on one file system: a file lands whole
                os.replace(spool / rel, fed / rel)
            now = time.monotonic()
            landed.update({str(rel): now for rel in batch})
            time.sleep(interval_s)
        # A window that never commits ends the run here rather than hanging the benchmark.
        if not stop.wait(120):
            print("paced: not every file committed within 120 s", file=sys.stderr)
            stop.set()

    def on_window(w: Any) -> None:
        now = time.monotonic()
        names = [str(Path(f)) for f in w.offsets.get("files", [])]
        out.plan_to_completed.append(w.latency_s)
        out.plan_to_visible.append(w.visible_s)
        out.land_to_completed.append(now - max(landed[n] for n in names))
        out.rows += int((w.stats or {}).get("kept", 0))
        committed.update(names)
        if len(committed) == len(files):
            stop.set()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    engine.run(
        max_units_per_window=files_per_window,
        follow=True,
        poll_interval_s=0.05,
        stop=stop,
        on_window=on_window,
    )
    feeder.join()
    return out


def window_batches(lake: Path) -> list[Any]:
    """The payments rows the engine wrote, one Arrow table per window, in window order."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    table = DeltaTable(str(lake / "payments")).to_pyarrow_table(columns=list(COLUMNS))
    ids = sorted(set(table.column("_window_id").to_pylist()))
    return [table.filter(pc.equal(table["_window_id"], w)) for w in ids]


def baseline_copy(server_dsn: str, batches: list[Any]) -> Measurement:
    """Plain psycopg COPY (CSV from Arrow), one transaction per window, same table shape."""
    import io

    import pyarrow.csv as pacsv

    dsn = fresh_database(server_dsn, "bench_copy")
    options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    statement = f"COPY payments_copy ({', '.join(COLUMNS)}) FROM STDIN (FORMAT csv)"
    with psycopg.connect(dsn) as conn:
        conn.execute(PAYMENT_DDL)
        conn.commit()
        latencies = []
        with MemorySampler() as mem:
            started = time.perf_counter()
            for batch in batches:
                t0 = time.perf_counter()
                buffer = io.BytesIO()
                pacsv.write_csv(batch, buffer, options)
                with conn.cursor() as cur, cur.copy(statement) as copy:
                    copy.write(buffer.getvalue())
                conn.commit()
                latencies.append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - started
    rows = sum(b.num_rows for b in batches)
    return Measurement(
        "psycopg COPY", rows, elapsed, len(batches), latencies, {}, mem.driver_peak / 2**20
    )


def baseline_delta(work: Path, batches: list[Any]) -> Measurement:
    """Plain `write_deltalake` appends, one commit per window."""
    from deltalake import write_deltalake

    path = work / f"plain-delta-{uuid.uuid4().hex[:6]}"
    latencies = []
    with MemorySampler() as mem:
        started = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            write_deltalake(str(path), batch, mode="append")
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
    rows = sum(b.num_rows for b in batches)
    return Measurement(
        "write_deltalake", rows, elapsed, len(batches), latencies, {}, mem.driver_peak / 2**20
    )


def timed(label: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    print(f"  {label}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return out


def run_peer_pipeline(
    spark: Any, server_dsn: str, work: Path, landing: Path, files_per_window: int
) -> Measurement:
    dsn = fresh_database(server_dsn, "bench_peer")
    tag = uuid.uuid4().hex[:6]
    with MemorySampler() as mem:
        peer = run_peer(
            spark,
            landing / "payments",
            work / f"peer-lake-{tag}",
            dsn,
            files_per_trigger=files_per_window,
            checkpoint_dir=work / f"peer-checkpoint-{tag}",
        )
    return Measurement(
        "peer",
        peer.rows,
        peer.seconds,
        peer.batches,
        peer.batch_latency,
        driver_peak_mb=mem.driver_peak / 2**20,
        driver_growth_mb=mem.driver_growth / 2**20,
        jvm_peak_mb=mem.jvm_peak / 2**20,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--files-per-window", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--duplicate-rate", type=float, default=0.05)
    parser.add_argument("--invalid-rate", type=float, default=0.01)
    parser.add_argument(
        "--baselines", action="store_true", help="also plain COPY and write_deltalake"
    )
    parser.add_argument(
        "--paced",
        type=float,
        default=1.5,
        metavar="SECONDS",
        help="also a follow run fed one window's files every SECONDS (0: skip)",
    )
    parser.add_argument("--dsn", default=os.environ.get("ONCEFLOW_BENCH_DSN"))
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    from onceflow.generate import generate_payments
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        server_dsn = args.dsn
        if not server_dsn:
            import pgserver

            server_dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        landing = work / "landing"
        print(f"generating {args.records:,} payments in {args.files} files ...", file=sys.stderr)
        timed(
            "generate",
            lambda: generate_payments(
                landing,
                records=args.records,
                files=args.files,
                duplicate_rate=args.duplicate_rate,
                invalid_rate=args.invalid_rate,
                seed=1,
            ),
        )
        spark = timed("spark session", lambda: build_spark_session(app_name="onceflow-bench"))
        # A whole run of each first, on input of the same size: the JVM compiles Spark's hot
        # paths (and each pipeline's generated code) before anything is timed, so neither pays
        # for the warm-up of the other. With two windows each, the first timed exactly-once
        # run (timed first) was still 1–2 s slower than the later ones, so one run alone
        # understated exactly-once against at-least-once.
        per = args.files_per_window
        warm = work / "warm-landing"
        generate_payments(warm, records=args.records, files=args.files, seed=2)
        timed(
            "warm-up",
            lambda: run_engine(spark, server_dsn, work, warm, "exactly_once", "w", per),
        )
        timed("warm-up peer", lambda: run_peer_pipeline(spark, server_dsn, work, warm, per))
        results: dict[str, list[Measurement]] = {}
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", file=sys.stderr)
            eo, lake = timed(
                "exactly_once",
                lambda: run_engine(spark, server_dsn, work, landing, "exactly_once", "eo", per),
            )
            alo, _ = timed(
                "at_least_once",
                lambda: run_engine(spark, server_dsn, work, landing, "at_least_once", "alo", per),
            )
            peer = timed("peer", lambda: run_peer_pipeline(spark, server_dsn, work, landing, per))
            found = [eo, alo, peer]
            if args.baselines:
                batches = window_batches(lake)
                found.append(timed("COPY", lambda b=batches: baseline_copy(server_dsn, b)))
                found.append(timed("write_deltalake", lambda b=batches: baseline_delta(work, b)))
            for m in found:
                results.setdefault(m.name, []).append(m)
        paced = None
        if args.paced > 0:
            paced = timed(
                "paced",
                lambda: run_paced(spark, server_dsn, work, landing, per, args.paced),
            )
        spark.stop()
        report(args, results, paced)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(
    args: argparse.Namespace, results: dict[str, list[Measurement]], paced: Paced | None = None
) -> None:
    def median(name: str) -> Measurement:
        ordered = sorted(results[name], key=lambda m: m.seconds)
        return ordered[(len(ordered) - 1) // 2]

    eo, alo, peer = median("eo"), median("alo"), median("peer")
    ram_gb = psutil.virtual_memory().total / 2**30
    print(
        f"\nmachine: {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), "
        f"{ram_gb:.1f} GiB RAM; load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"input: {args.records:,} payments, {args.files} files, {args.files_per_window} files "
        f"per window; runs: {args.runs} (median run shown)\n"
    )
    header = (
        f"{'writer':<28} {'rows out':>10} {'seconds':>8} {'rows/s':>10} {'windows':>7} "
        f"{'p50 win s':>9} {'p95 win s':>9} {'driver MB':>9} {'+MB':>5} {'JVM MB':>7}"
    )
    print(header)
    print("-" * len(header))
    named = [
        ("onceflow exactly_once", eo),
        ("onceflow at_least_once", alo),
        ("peer (Structured Streaming)", peer),
    ]
    if "psycopg COPY" in results:
        named += [
            ("plain psycopg COPY", median("psycopg COPY")),
            ("plain write_deltalake", median("write_deltalake")),
        ]
    for label, m in named:
        print(
            f"{label:<28} {m.rows:>10,} {m.seconds:>8.1f} {m.rows_per_s:>10,.0f} {m.windows:>7} "
            f"{percentile(m.window_latency, 50):>9.3f} {percentile(m.window_latency, 95):>9.3f} "
            f"{m.driver_peak_mb:>9.0f} {m.driver_growth_mb:>5.0f} "
            f"{m.jvm_peak_mb if m.jvm_peak_mb else float('nan'):>7.0f}"
        )
    print("\nratios (same run, same input):")
    print(f"  onceflow exactly_once / peer wall time:   {eo.seconds / peer.seconds:.2f}x")
    print(f"  onceflow at_least_once / peer wall time:  {alo.seconds / peer.seconds:.2f}x")
    print(f"  exactly_once / at_least_once throughput:  {eo.rows_per_s / alo.rows_per_s:.2f}")
    print(
        "  (the peer is at-least-once: it keeps invalid lines and doubles balances on a replay;"
        " its rows out count duplicates across batches)"
    )

    def p50_p95(values: list[float]) -> str:
        return f"p50 {percentile(values, 50):.3f} s, p95 {percentile(values, 95):.3f} s"

    runs = results["eo"]
    print(
        f"\nwindow latency, exactly_once, every run's {sum(m.windows for m in runs)} windows "
        "(input all landed: each window is planned as the one before commits, the two sharing "
        "the cores):"
    )
    print(
        "  plan → committed in every sink:     "
        + p50_p95([v for m in runs for v in m.window_visible])
    )
    print(
        "  plan → completed (keys indexed):    "
        + p50_p95([v for m in runs for v in m.window_latency])
    )
    if paced is not None:
        print(
            f"paced: one window's files landing every {paced.interval_s:g} s, a follow run "
            f"({len(paced.plan_to_completed)} windows, {paced.rows:,} rows):"
        )
        print("  plan → committed in every sink:     " + p50_p95(paced.plan_to_visible))
        print("  plan → completed (keys indexed):    " + p50_p95(paced.plan_to_completed))
        print("  landed → completed:                 " + p50_p95(paced.land_to_completed))
    print("\nper-sink commit latency (exactly_once), seconds:")
    for sink, values in sorted(eo.sink_latency.items()):
        print(
            f"  {sink:<22} p50 {percentile(values, 50):.3f}  p95 {percentile(values, 95):.3f}"
            f"  max {max(values):.3f}  (n={len(values)})"
        )
    if args.runs > 1:
        for name in ("eo", "alo", "peer"):
            spread = ", ".join(f"{m.seconds:.1f}" for m in results[name])
            print(f"{name} seconds per run: {spread}")
        # Each run's own ratio: the machine's speed drifts between runs, less within one.
        for name in ("eo", "alo"):
            ratios = sorted(
                m.seconds / p.seconds for m, p in zip(results[name], results["peer"], strict=True)
            )
            spread = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"{name} / peer per run: {spread} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
