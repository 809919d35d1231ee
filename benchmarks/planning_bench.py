"""How long the driver takes to plan one `payments` window's outputs, with no Spark job run.

Runs one window of `payments` (4 files, 20,000 lines) into a fresh database and lake, then
plans that window's outputs (`Engine.outputs`: the source read, the parse, the key lookup,
the dedupe, the transform, the quarantine rows and the key rows) `--repeat` times in the warm
session, releasing each plan, and prints the median and the 10th percentile after
`--warmup` plans, with the py4j round trips the driver sent the JVM per plan.

Planning runs on the driver before every window's Spark job, so it is on each window's
critical path. Compare two versions by running this with each on `PYTHONPATH`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from payments_bench import fresh_database
from window_profile import Timers, count_round_trips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
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
        seconds, trips, releases = [], [], []
        for _ in range(args.warmup + args.repeat):
            with timers.active():
                started = time.perf_counter()
                out = engine.outputs(window)
                seconds.append(time.perf_counter() - started)
            trips.append(timers.round_trips)
            releases.append(timers.releases)
            out.release()
        spark.stop()
        timed = sorted(seconds[args.warmup :])
        print(
            f"planning one window's outputs: median {statistics.median(timed) * 1e3:.1f} ms, "
            f"10th percentile {timed[len(timed) // 10] * 1e3:.1f} ms over {len(timed)} plans; "
            f"{statistics.median(trips):.0f} py4j round trips a plan, "
            f"{statistics.median(releases):.0f} of them releasing collected JVM objects "
            f"(machine: {os.cpu_count()} cores)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
