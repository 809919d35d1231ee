"""Benchmark: what the ledger keeps per window, before and after `onceflow maintain`.

Runs the `payments` job (a Delta and a PostgreSQL payments sink, the accumulating balances)
on `--windows` landed files, one window each, on an embedded PostgreSQL server and one Spark
session; then measures each `onceflow` table (rows, and the bytes of their data) and divides
by the windows. Then `maintain --keep-detail-days 0` (every window past the detail horizon)
and the same again. Prints one line per table: rows and bytes per window, before and after.

    .venv/bin/python benchmarks/ledger_bytes_bench.py [--windows 40] [--records-per-file 25]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from onceflow import Settings, ops
from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.registry import get_job

JOB = "payments"


def measure(dsn: str) -> dict[str, tuple[int, int]]:
    """Table → (rows, bytes of the rows' data): `pg_column_size` of each row, without page,
    tuple-header and index overhead (fixed pages would swamp a short history)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [
            str(name)
            for (name,) in conn.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = 'onceflow'::regnamespace"
                " AND relkind = 'r' ORDER BY relname"
            )
        ]
        out = {}
        for table in tables:
            ident = sql.Identifier("onceflow", table)
            row = conn.execute(
                sql.SQL(
                    "SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0) FROM {} AS t"
                ).format(ident)
            ).fetchone()
            assert row is not None
            out[table] = (int(row[0]), int(row[1]))
    return out


def window_columns(dsn: str) -> dict[str, float]:
    """Column → the average `pg_column_size` of it over the job's `windows` rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        columns = [
            str(name)
            for (name,) in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema ="
                " 'onceflow' AND table_name = 'windows' ORDER BY ordinal_position"
            )
        ]
        row = conn.execute(
            sql.SQL("SELECT {} FROM onceflow.windows WHERE job = %s").format(
                sql.SQL(", ").join(
                    sql.SQL("coalesce(avg(pg_column_size({})), 0)").format(sql.Identifier(c))
                    for c in columns
                )
            ),
            (JOB,),
        ).fetchone()
    assert row is not None
    return {c: float(v) for c, v in zip(columns, row, strict=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--records-per-file", type=int, default=25)
    args = parser.parse_args(argv)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-ledger-bytes-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        settings = Settings(
            home=work / "home", postgres_dsn=dsn, lake=work / "lake", landing=work / "landing"
        )
        settings.check_folders()
        generate_payments(
            settings.landing.path,
            records=args.windows * args.records_per_file,
            files=args.windows,
            duplicate_rate=0.1,
            invalid_rate=0.05,
            seed=3,
        )
        spark = build_spark_session(app_name="onceflow-ledger-bytes")
        job = get_job(JOB)
        Engine(job, settings, spark, dsn).run(max_units_per_window=1)
        before = measure(dsn)
        result = ops.maintain(job, settings, dsn=dsn, jobs=[job], keep_detail_days=0)
        print(result.detail.line(dry_run=False))
        after = measure(dsn)
        n = args.windows
        print(f"\n{args.windows} windows of {args.records_per_file} records each, per window:")
        print(f"{'table':<22} {'rows before':>11} {'bytes before':>12} {'rows after':>10} "
              f"{'bytes after':>11}")  # fmt: skip
        totals = [0, 0]
        for table in before:
            (rb, bb), (ra, ba) = before[table], after.get(table, (0, 0))
            if not rb and not ra:
                continue
            totals[0] += bb
            totals[1] += ba
            print(f"{table:<22} {rb / n:>11.2f} {bb / n:>12.0f} {ra / n:>10.2f} {ba / n:>11.0f}")
        print(f"{'all':<22} {'':>11} {totals[0] / n:>12.0f} {'':>10} {totals[1] / n:>11.0f}")
        print("(row data only: each row adds about 24 bytes of header and its index entries)")
        print("\nthe columns of a `windows` row (average bytes):")
        for column, size in window_columns(dsn).items():
            print(f"  {column:<20} {size:>6.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
