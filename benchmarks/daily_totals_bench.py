"""`daily_totals` over a large `payments` table: wall time of one run, checked exact.

Builds the payments Delta table directly (N appends of generated rows, with the columns the
payments job writes), runs the daily_totals job once over every version, and compares the
PostgreSQL totals with a pyarrow group-by of the table. Prints one line of figures.

    .venv/bin/python benchmarks/daily_totals_bench.py --payments 1000000 --versions 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake


def payments_batch(rng: np.random.Generator, start: int, rows: int, window: int) -> pa.Table:
    base = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp() * 1_000_000)
    micros = base + rng.integers(0, 365 * 86_400_000_000, rows)
    return pa.table(
        {
            "payment_id": [f"p-{i:010d}" for i in range(start, start + rows)],
            "merchant_id": [f"m-{i:05d}" for i in rng.integers(0, 5000, rows)],
            "customer_id": [f"c-{i:07d}" for i in rng.integers(0, 100000, rows)],
            "amount_cents": pa.array(rng.integers(-50_000, 5_000_000, rows), pa.int64()),
            "currency": pa.array(rng.choice(["EUR", "USD", "GBP", "JPY"], rows)),
            "created_at": pa.array(micros, pa.timestamp("us", tz="UTC")),
            "_window_id": pa.array(np.full(rows, window), pa.int64()),
            "_source_file": pa.array(np.full(rows, f"payments/f{window}.jsonl")),
            "_source_line": pa.array(np.arange(1, rows + 1), pa.int64()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--payments", type=int, default=1_000_000)
    parser.add_argument("--versions", type=int, default=10)
    args = parser.parse_args()

    import pgserver
    import psycopg

    from onceflow.engine import Engine
    from onceflow.registry import get_job
    from onceflow.settings import Settings
    from onceflow.spark import build_spark_session

    root = Path(tempfile.mkdtemp(prefix="onceflow-dt-bench-"))
    root.chmod(0o755)
    (root / "pg").mkdir()
    (root / "pg").chmod(0o755)
    server = pgserver.get_server(root / "pg", cleanup_mode="delete")
    dsn = server.get_uri()
    lake, landing = root / "lake", root / "landing"
    landing.mkdir(parents=True)
    rng = np.random.default_rng(7)
    per = args.payments // args.versions
    t0 = time.perf_counter()
    for v in range(args.versions):
        write_deltalake(
            str(lake / "payments"), payments_batch(rng, v * per, per, v + 1), mode="append"
        )
    built = time.perf_counter() - t0

    spark = build_spark_session(app_name="daily-totals-bench")
    settings = Settings(home=root / "home", postgres_dsn=dsn, lake=lake, landing=landing)
    engine = Engine(get_job("daily_totals"), settings, spark, dsn)
    t0 = time.perf_counter()
    result = engine.run()
    wall = time.perf_counter() - t0

    from deltalake import DeltaTable

    table = DeltaTable(str(lake / "payments")).to_pyarrow_table()
    day = pc.cast(table["created_at"], pa.date32())
    grouped = (
        pa.table({"day": day, "currency": table["currency"], "a": table["amount_cents"]})
        .group_by(["day", "currency"])
        .aggregate([("a", "sum"), ("a", "count")])
    )
    want = {(r["day"], r["currency"]): (r["a_sum"], r["a_count"]) for r in grouped.to_pylist()}
    with psycopg.connect(dsn) as conn:
        got = {
            (d, c): (int(t), int(n))
            for d, c, t, n in conn.execute(
                "SELECT day, currency, total_cents, payment_count FROM daily_totals"
            )
        }
    exact = got == want
    print(
        f"daily_totals: {args.payments} payments in {args.versions} versions "
        f"(table built in {built:.1f}s); one run: {len(result.windows)} window(s), "
        f"{wall:.1f}s wall, {args.payments / wall:,.0f} payments/s; {len(got)} (day, currency) "
        f"rows; exact: {exact}"
    )
    spark.stop()
    server.cleanup()
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
