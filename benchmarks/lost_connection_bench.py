"""Benchmark: what surviving lost PostgreSQL connections costs a clean run, and how many runs
finish the input when a share of COMMIT answers is lost.

Each measured run is a real `onceflow run payments` process on a fresh database, lake and copy
of one generated input, against one embedded PostgreSQL server. Give several `--platform`
folders (each holding an `onceflow` package, e.g. an older checkout's `platform/`) to compare
them; their runs are interleaved so other load on the machine hits them alike.

    .venv/bin/python benchmarks/lost_connection_bench.py --platform /tmp/old/platform \\
        --platform platform --repeat 3
    .venv/bin/python benchmarks/lost_connection_bench.py --platform platform --lose-commits 0.1

With `--lose-commits P` every run goes through a proxy (tests/support/pgproxy.py) that forwards
each COMMIT and, with probability P, cuts the connection once the server has answered; runs are
repeated until one exits 0 having left nothing pending (at most `--max-runs`), then the outputs
are compared with the oracle (lost and doubled records). `--lose-commits 0` still goes through
the proxy and counts the run's connections and COMMITs; leave it out for direct runs.

`--copy-rows N` instead times the executors' COPY into a staging table (`copy_frame`, N rows of
payment-like columns, 4 partitions) with each platform, the one place the change costs per byte
(the spool that lets a cut-off COPY be sent again).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _database(server_dsn: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


def _run(platform: Path, dsn: str, site: Path, max_files: int) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env.update(
        PYTHONPATH=str(platform),
        PYSPARK_PYTHON=sys.executable,
        ONCEFLOW_HOME=str(site / "home"),
        ONCEFLOW_POSTGRES_DSN=dsn,
        ONCEFLOW_LAKE=str(site / "lake"),
        ONCEFLOW_LANDING=str(site / "landing"),
        GX_ANALYTICS_ENABLED="false",
    )
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "run",
            "payments",
            "--max-files-per-window",
            str(max_files),
        ],
        env=env,
        cwd=site,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    wall = time.monotonic() - started
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode, wall, last


def _site(root: Path, input_root: Path) -> Path:
    site = root / uuid.uuid4().hex[:8]
    (site / "home").mkdir(parents=True)
    shutil.copytree(input_root, site / "landing")
    return site


def _pending(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM onceflow.windows WHERE job = 'payments' AND completed_at IS NULL"
        ).fetchone()
    return int(row[0]) if row else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", action="append", type=Path, required=True)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--max-files-per-window", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lose-commits", type=float, default=None)
    parser.add_argument("--copy-rows", type=int, default=0)
    parser.add_argument("--max-runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()

    import pgserver

    from onceflow.generate import generate_payments
    from tests.support.oracle import expected_outputs
    from tests.support.outputs import actual_outputs, diff_outputs
    from tests.support.pgproxy import PgProxy

    work = Path(tempfile.mkdtemp(prefix="onceflow-lostconn-bench-"))
    work.chmod(0o755)
    server = pgserver.get_server(work / "pg", cleanup_mode="delete")
    try:
        if args.copy_rows:
            return _copy_bench(args, server.get_uri())
        generate_payments(
            work / "input",
            records=args.records,
            files=args.files,
            duplicate_rate=0.1,
            invalid_rate=0.05,
        )
        walls: dict[Path, list[float]] = {p: [] for p in args.platform}
        for repeat in range(args.repeat):
            for platform in args.platform:
                site = _site(work, work / "input")
                dsn = _database(server.get_uri())
                if args.lose_commits is None:
                    rc, wall, last = _run(platform, dsn, site, args.max_files_per_window)
                    if rc != 0:
                        print(f"{platform}: run failed ({rc}): {last}")
                        return 1
                    walls[platform].append(wall)
                    print(f"{platform}: clean run {repeat + 1}: {wall:.1f}s", flush=True)
                    continue
                with PgProxy(dsn) as proxy:
                    proxy.flaky(commits=args.lose_commits, seed=args.seed + repeat)
                    through = proxy.dsn(str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]))
                    outcomes = []
                    for _ in range(args.max_runs):
                        rc, wall, last = _run(platform, through, site, args.max_files_per_window)
                        outcomes.append((rc, wall, last))
                        if rc == 0 and _pending(dsn) == 0:
                            break
                    lost, commits = proxy.lost("commit"), proxy.commits
                    connections = proxy.connections
                diffs = diff_outputs(
                    expected_outputs(site / "landing"), actual_outputs(dsn, site / "lake")
                )
                finished = outcomes[-1][0] == 0
                print(
                    f"{platform}: {'finished' if finished else 'NOT finished'} in "
                    f"{len(outcomes)} run(s) ({sum(o[1] for o in outcomes):.0f}s), "
                    f"{connections} connections, {lost} of {commits} COMMIT answers lost; "
                    "lost records "
                    f"{sum(d.lost for d in diffs.values())}, doubled "
                    f"{sum(d.doubled for d in diffs.values())}",
                    flush=True,
                )
                for rc, wall, last in outcomes:
                    if rc != 0:
                        print(f"    exit {rc} after {wall:.0f}s: {last[:300]}")
        if args.lose_commits is None:
            for platform, times in walls.items():
                print(
                    f"{platform}: clean `onceflow run payments` ({args.files} files): median "
                    f"{statistics.median(times):.1f}s over {times}"
                )
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


_COPY_SCRIPT = """
import sys, time
import psycopg
from onceflow.spark import build_spark_session
from onceflow._pgcopy import copy_frame

dsn, rows = sys.argv[1], int(sys.argv[2])
spark = build_spark_session(app_name="copy-bench")
df = spark.range(rows, numPartitions=4).selectExpr(
    "concat('p', id) AS payment_id", "concat('m', id % 1000) AS merchant_id",
    "id * 7 AS amount_cents", "'EUR' AS currency", "current_timestamp() AS created_at",
).cache()
df.count()
cols = ["payment_id", "merchant_id", "amount_cents", "currency", "created_at"]
times = []
for i in range(3):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS onceflow")
        conn.execute("DROP TABLE IF EXISTS onceflow.copy_bench")
        conn.execute("CREATE UNLOGGED TABLE onceflow.copy_bench (payment_id text,"
                     " merchant_id text, amount_cents bigint, currency text, created_at timestamptz)")
    started = time.monotonic()
    assert copy_frame(dsn, "copy-bench", "copy_bench", cols, df) == rows
    times.append(time.monotonic() - started)
print(" ".join(f"{t:.2f}" for t in times))
"""


def _copy_bench(args: argparse.Namespace, server_dsn: str) -> int:
    times: dict[Path, list[float]] = {p: [] for p in args.platform}
    for _ in range(args.repeat):
        for platform in args.platform:
            dsn = _database(server_dsn)
            env = dict(os.environ, PYTHONPATH=str(platform), PYSPARK_PYTHON=sys.executable)
            done = subprocess.run(
                [sys.executable, "-c", _COPY_SCRIPT, dsn, str(args.copy_rows)],
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                print(f"{platform}: failed: {done.stderr[-1500:]}")
                return 1
            got = [float(t) for t in done.stdout.split()[-3:]]
            times[platform] += got
            print(f"{platform}: copy_frame of {args.copy_rows} rows: {got}", flush=True)
    for platform, got in times.items():
        print(f"{platform}: copy_frame median {statistics.median(got):.2f}s over {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
