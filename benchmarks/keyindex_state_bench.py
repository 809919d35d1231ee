"""Benchmark: a run's first look at the dedupe key index (`KeyIndex.state`) on long histories.

For each size a job's ledger gets that many completed windows, all in the key index
(`windows` and `dedupe_windows` rows by `generate_series`, then `VACUUM ANALYZE`), on an
embedded PostgreSQL server; then the first look a run makes (`reset`, `state(n + 1)`) is timed,
median of `--repeat`, with the ratio to the smallest size.

    .venv/bin/python benchmarks/keyindex_state_bench.py --sizes 100,10000,100000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from onceflow._keyindex import DDL, KeyIndex
from onceflow.ledger import Ledger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,10000,100000")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    import pgserver

    work = Path(tempfile.mkdtemp(prefix="onceflow-keyindex-bench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        times: dict[int, float] = {}
        for n in [int(s) for s in args.sizes.split(",") if s]:
            job = f"bench_{n}"
            ledger = Ledger(dsn, job)
            ledger.ensure_schema()
            with psycopg.connect(dsn) as conn:
                conn.execute(DDL)
                conn.execute(
                    "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, completed_at)"
                    " SELECT %s, i, '{}', 1, now() FROM generate_series(1, %s) AS i",
                    (job, n),
                )
                conn.execute(
                    "INSERT INTO onceflow.dedupe_windows (job, window_id, keys)"
                    " SELECT %s, i, 20 FROM generate_series(1, %s) AS i",
                    (job, n),
                )
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE onceflow.windows")
                conn.execute("VACUUM ANALYZE onceflow.dedupe_windows")
            index = KeyIndex(dsn, job, ledger)
            index.state(2)  # the session's first queries
            samples = []
            for _ in range(args.repeat):
                index.reset()
                started = time.perf_counter()
                state = index.state(n + 1)
                samples.append(time.perf_counter() - started)
                assert state.settled == n + 1 and not state.missing, state
            times[n] = statistics.median(samples)
        base = times[min(times)]
        print(f"{'windows':>8} {'first look':>11} {'ratio':>6}")
        for n, t in times.items():
            print(f"{n:>8} {t * 1000:>9.1f}ms {t / base:>5.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
