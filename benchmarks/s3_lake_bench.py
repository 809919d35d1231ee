"""Benchmark: `onceflow run payments` as a user runs it, with the lake on the local disk vs on an
S3-compatible store (the project's local S3 server), and with the landing files there too.

One invocation, one generated input (200,000 payments in 40 files by default), the same window
size, a fresh database and lake for each mode; each mode is the real CLI in a new process, timed
from start to exit. The store is moto's server on the same machine: the ratio shows what the
object-store path costs (HTTP round trips, whole-object PUTs, no local rename), not a network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cli_sites import run_cli, site_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--files-per-window", type=int, default=4)
    parser.add_argument("--dsn", default=os.environ.get("ONCEFLOW_BENCH_DSN"))
    args = parser.parse_args(argv)

    from onceflow.generate import generate_payments
    from onceflow.s3_server import LocalS3
    from onceflow.storage import Location

    work = Path(tempfile.mkdtemp(prefix="onceflow-s3-bench-"))
    work.chmod(0o755)
    pg = None
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
        window = ("--max-files-per-window", str(args.files_per_window))
        results: dict[str, float] = {}
        results["local lake"] = run_cli(
            site_env(work, server_dsn, "local", source / "payments"), "run", "payments", *window
        )
        with LocalS3(log=work / "s3.log") as s3:
            s3.create_bucket("bench")
            on_s3 = {**s3.env(), "ONCEFLOW_LAKE": "s3://bench/lake"}
            results["S3 lake"] = run_cli(
                site_env(work, server_dsn, "s3", source / "payments", **on_s3),
                "run", "payments", *window,
            )  # fmt: skip
            landing = Location.parse("s3://bench/landing", s3.env())
            for path in sorted((source / "payments").iterdir()):
                (landing / "payments" / path.name).write_bytes(path.read_bytes())
            both = {**on_s3, "ONCEFLOW_LAKE": "s3://bench/lake2", "ONCEFLOW_LANDING": landing.uri}
            results["S3 lake + landing"] = run_cli(
                site_env(work, server_dsn, "s3both", None, **both), "run", "payments", *window
            )
        print(
            f"\n`onceflow run payments`, {args.records:,} payments in {args.files} files, "
            f"{args.files_per_window} files per window, {os.cpu_count()} cores, "
            f"load {os.getloadavg()[0]:.1f}"
        )
        local = results["local lake"]
        for mode, wall in results.items():
            print(f"  {mode:>18}: {wall:6.1f}s  {wall / local:5.2f}x")
    finally:
        if pg is not None:
            pg.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
