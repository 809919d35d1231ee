"""Benchmark: `onceflow run payments` as a user runs it, on `local[2]` vs a two-worker cluster.

One invocation, one generated input (200,000 payments in 40 files by default), the same window
size, a fresh database and lake for each mode. Each mode is the real CLI in a new process, timed
from start to exit: `local` is the default `local[2]` session; `cluster` sets
`ONCEFLOW_SPARK_MASTER` to a standalone master with two workers of one core each, started
(`onceflow.spark_cluster`) before the clock starts. On one machine the ratio shows the cluster's
overhead (executors in JVMs of their own, rows and results over the network), not a speed-up.
`--s3` adds the cluster with the lake on the project's local S3 server (`onceflow.s3_server`).
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
    parser.add_argument("--s3", action="store_true", help="also the cluster with the lake on S3")
    args = parser.parse_args(argv)

    from onceflow.generate import generate_payments
    from onceflow.spark_cluster import local_cluster

    work = Path(tempfile.mkdtemp(prefix="onceflow-cluster-bench-"))
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

        def site(name: str, master: str | None, **extra: str) -> dict[str, str]:
            cluster_url = {"ONCEFLOW_SPARK_MASTER": master} if master else {}
            return site_env(work, server_dsn, name, source / "payments", **cluster_url, **extra)

        window = ("--max-files-per-window", str(args.files_per_window))
        results: dict[str, float] = {}
        results["local"] = run_cli(site("local", None), "run", "payments", *window)
        with local_cluster(work / "cluster", workers=2, cores=1) as cluster:
            results["cluster"] = run_cli(site("cluster", cluster.url), "run", "payments", *window)
            if args.s3:
                from onceflow.s3_server import LocalS3

                with LocalS3(log=work / "s3.log") as s3:
                    s3.create_bucket("bench")
                    on_s3 = {**s3.env(), "ONCEFLOW_LAKE": "s3://bench/lake"}
                    results["cluster, S3 lake"] = run_cli(
                        site("cluster_s3", cluster.url, **on_s3), "run", "payments", *window
                    )
        for mode, wall in results.items():
            print(f"{mode}: {wall:.1f}s for {args.records:,} payments")
        print(
            f"\n`onceflow run payments`, {args.records:,} payments in {args.files} files, "
            f"{args.files_per_window} files per window, {os.cpu_count()} cores, "
            f"load {os.getloadavg()[0]:.1f}"
        )
        local = results["local"]
        for mode, wall in results.items():
            print(f"  {mode:>18}: {wall:6.1f}s  {wall / local:5.2f}x local[2]")
    finally:
        if pg is not None:
            pg.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
