"""How long the driver takes to plan one `payments` window's outputs, with no Spark job run.

Runs one window of `payments` (4 files, 20,000 lines) into a fresh database and lake, then
plans that window's outputs (`Engine.outputs`: the source read, the parse, the key lookup,
the dedupe, the transform, the quarantine rows and the key rows) `--repeat` times in the warm
session, releasing each plan, and prints the median and the 10th percentile after
`--warmup` plans, with the py4j round trips the driver sent the JVM per plan.

Planning runs on the driver before every window's Spark job, so it is on each window's
critical path. Compare two versions by running this with each on `PYTHONPATH`.

`--sites` also times the py4j commands by where they come from (the innermost onceflow function
and the PySpark call it made): a command's time is the JVM's work for it (analysing the new
plan, caching, listing files) and the round trip.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from payments_bench import fresh_database
from window_profile import Timers, call_site, count_round_trips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sites", action="store_true", help="time py4j commands by call site")
    args = parser.parse_args(argv)

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.engine import build_engine
    from onceflow.generate import generate_payments
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.settings import Settings
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-planning-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        server_dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        landing = work / "landing"
        generate_payments(
            landing, records=20_000, files=4, seed=1, duplicate_rate=0.05, invalid_rate=0.01
        )
        spark = build_spark_session(app_name="onceflow-planning")
        dsn = fresh_database(server_dsn, "planning")
        settings = Settings(
            home=work / "home", postgres_dsn=dsn, lake=work / "lake", landing=landing
        )
        engine = build_engine(PAYMENTS, settings, spark, dsn)
        engine.prepare()
        engine.run(max_units_per_window=4)
        window = engine.ledger.windows()[-1]

        timers = Timers()
        count_round_trips(timers)
        sites = time_by_site(timers) if args.sites else None
        seconds, trips, releases = [], [], []
        for _ in range(args.warmup + args.repeat):
            with timers.active():
                started = time.perf_counter()
                out = engine.outputs(window)
                seconds.append(time.perf_counter() - started)
            trips.append(timers.round_trips)
            releases.append(timers.releases)
            out.release()
            if sites is not None and len(seconds) == args.warmup:
                sites.clear()  # the warm-up's plans are not counted
        spark.stop()
        timed = sorted(seconds[args.warmup :])
        print(
            f"planning one window's outputs: median {statistics.median(timed) * 1e3:.1f} ms, "
            f"10th percentile {timed[len(timed) // 10] * 1e3:.1f} ms over {len(timed)} plans; "
            f"{statistics.median(trips):.0f} py4j round trips a plan, "
            f"{statistics.median(releases):.0f} of them releasing collected JVM objects "
            f"(machine: {os.cpu_count()} cores)"
        )
        if sites is not None:
            print("py4j commands a plan, by call site (time, commands):")
            for site, (spent, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:20]:
                print(f"  {spent / args.repeat * 1e3:7.1f} ms {count / args.repeat:6.1f}  {site}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def time_by_site(timers: Timers) -> dict[str, list[float]]:
    """Time every py4j command sent while `timers` is on, by `call_site()`: [seconds, count]."""
    from py4j.clientserver import ClientServerConnection

    sites: dict[str, list[float]] = {}
    original = ClientServerConnection.send_command

    @functools.wraps(original)
    def timed(connection: Any, command: str, *args: Any, **kwargs: Any) -> Any:
        if not timers.on:
            return original(connection, command, *args, **kwargs)
        started = time.perf_counter()
        try:
            return original(connection, command, *args, **kwargs)
        finally:
            entry = sites.setdefault(call_site(), [0.0, 0])
            entry[0] += time.perf_counter() - started
            entry[1] += 1

    ClientServerConnection.send_command = timed  # type: ignore[method-assign]
    return sites


if __name__ == "__main__":
    sys.exit(main())
