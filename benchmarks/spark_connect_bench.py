"""Benchmark: `onceflow run payments` as a user runs it, on a local session vs a Spark Connect server.

One invocation, one generated input (200,000 payments in 40 files by default), the same window
size, a fresh database and lake for each mode. Each mode is the real CLI in a new process, timed
from start to exit: `local` starts its own Spark JVM (as every run did before the server), `connect`
attaches to an `onceflow spark-server` started (and warmed by one small run) before the clock
starts, as `make dev` keeps one running. Prints wall times and their ratio, and the start-up cost
alone (a run with nothing to do).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cli_sites import run_cli, site_env

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--files-per-window", type=int, default=4)
    parser.add_argument("--dsn", default=os.environ.get("ONCEFLOW_BENCH_DSN"))
    args = parser.parse_args(argv)

    from onceflow.generate import generate_payments
    from onceflow.spark_server import SparkServer, SparkServerConfig, free_port

    work = Path(tempfile.mkdtemp(prefix="onceflow-connect-bench-"))
    work.chmod(0o755)
    pg = None
    server = None
    try:
        server_dsn = args.dsn
        if not server_dsn:
            import pgserver

            pg = pgserver.get_server(work / "pg", cleanup_mode="stop")
            server_dsn = pg.get_uri()
        source = work / "input"
        generate_payments(
            source, records=args.records, files=args.files, duplicate_rate=0.02, seed=11
        )
        server = SparkServer(
            SparkServerConfig(port=free_port()),
            work / "spark_server.log",
            {**os.environ, "PYTHONPATH": str(ROOT)},
        ).start()

        def site(name: str, remote: bool, records: Path | None) -> dict[str, str]:
            remote_url = {"ONCEFLOW_SPARK_REMOTE": server.url} if remote else {}
            return site_env(work, server_dsn, name, records, **remote_url)

        # Warm the server once (its first session loads classes), as a running server would be.
        warm = work / "warm"
        generate_payments(warm, records=2000, files=2, seed=3)
        run_cli(site("warm", True, warm / "payments"), "run", "payments")

        window = ("--max-files-per-window", str(args.files_per_window))
        results: dict[str, dict[str, float]] = {}
        for mode, remote in (("local", False), ("connect", True)):
            empty = site(f"{mode}_empty", remote, None)
            startup = run_cli(empty, "run", "payments")
            wall = run_cli(site(mode, remote, source / "payments"), "run", "payments", *window)
            results[mode] = {"wall": wall, "startup": startup}
            print(f"{mode}: {wall:.1f}s for {args.records:,} payments; empty run {startup:.1f}s")

        local, connect = results["local"], results["connect"]
        print(
            f"\n`onceflow run payments`, {args.records:,} payments in {args.files} files, "
            f"{args.files_per_window} files per window, {os.cpu_count()} cores, "
            f"load {os.getloadavg()[0]:.1f}"
        )
        print(f"  {'':<26} {'local session':>14} {'Spark Connect':>14} {'connect/local':>14}")
        for key, label in (("wall", "wall time"), ("startup", "run with nothing to do")):
            ratio = connect[key] / local[key]
            print(f"  {label:<26} {local[key]:13.1f}s {connect[key]:13.1f}s {ratio:13.2f}x")
    finally:
        if server is not None:
            server.stop()
        if pg is not None:
            pg.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
