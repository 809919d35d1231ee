"""Benchmark: validation per sink and reconcile (full, incremental) at scale, with 1% damage."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

sys.path.insert(0, str(Path(__file__).parent))
from payments_bench import MemorySampler, fresh_database


def damage(dsn: str, lake: Path, fraction: float, seed: int) -> dict[str, int]:
    """Damage each output by about `fraction` of its rows, by hand, outside onceflow."""
    done: dict[str, int] = {}
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT setseed(%s)", (seed / 1000,))
        n = conn.execute("SELECT count(*) FROM payments").fetchone()[0]
        k = max(1, int(n * fraction / 2))
        done["pg_payments deleted"] = conn.execute(
            "DELETE FROM payments WHERE payment_id IN"
            " (SELECT payment_id FROM payments ORDER BY random() LIMIT %s)",
            (k,),
        ).rowcount
        done["pg_payments changed"] = conn.execute(
            "UPDATE payments SET amount_cents = amount_cents + 1 WHERE payment_id IN"
            " (SELECT payment_id FROM payments ORDER BY random() LIMIT %s)",
            (k,),
        ).rowcount
        b = conn.execute("SELECT count(*) FROM merchant_balances").fetchone()[0]
        done["balances changed"] = conn.execute(
            "UPDATE merchant_balances SET total_cents = total_cents + 7 WHERE (merchant_id, currency)"
            " IN (SELECT merchant_id, currency FROM merchant_balances ORDER BY random() LIMIT %s)",
            (max(1, int(b * fraction)),),
        ).rowcount
        q = conn.execute("SELECT count(*) FROM onceflow.quarantine").fetchone()[0]
        done["quarantine deleted"] = conn.execute(
            "DELETE FROM onceflow.quarantine WHERE (source_file, source_line) IN"
            " (SELECT source_file, source_line FROM onceflow.quarantine ORDER BY random()"
            " LIMIT %s)",
            (max(1, int(q * fraction)),),
        ).rowcount
        conn.commit()
    # The bench process may hold the whole table: this is the damage, not the code under test.
    data = DeltaTable(str(lake / "payments")).to_pyarrow_table()
    copies = data.filter(pc.less(pc.random(len(data)), fraction))
    write_deltalake(str(lake / "payments"), copies, mode="append")
    done["lake_payments duplicated"] = len(copies)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--damage", type=float, default=0.01)
    args = parser.parse_args(argv)

    import pgserver

    from onceflow.engine import Engine
    from onceflow.generate import generate_payments
    from onceflow.reconcile import format_report, reconcile
    from onceflow.registry import get_job
    from onceflow.settings import Settings
    from onceflow.spark import build_spark_session
    from onceflow.validation import validate_job

    work = Path(tempfile.mkdtemp(prefix="onceflow-recovery-bench-"))
    work.chmod(0o755)
    server = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
    dsn = fresh_database(server, "rb")
    landing, lake = work / "landing", work / "lake"
    settings = Settings(home=work / "home", postgres_dsn=dsn, lake=lake, landing=landing)
    settings.check_folders()
    generate_payments(
        landing, records=args.records, files=args.files, duplicate_rate=0.02,
        invalid_rate=0.01, seed=1,
    )  # fmt: skip
    spark = build_spark_session(app_name="onceflow-recovery-bench")
    engine = Engine(get_job("payments"), settings, spark, dsn)
    t0 = time.perf_counter()
    engine.run(max_units_per_window=1)
    load_s = time.perf_counter() - t0
    print(f"loaded {args.records:,} payments in {load_s:.1f}s", file=sys.stderr)

    rows: list[tuple[str, float, float]] = []

    def measure(label: str, fn: object) -> object:
        with MemorySampler() as mem:
            t = time.perf_counter()
            out = fn()  # type: ignore[operator]
            rows.append((label, time.perf_counter() - t, mem.driver_peak / 2**20))
        return out

    report = measure("validate (all suites)", lambda: validate_job(engine))
    assert report.passed, report.failures()
    suite_times = dict(report.timings)
    damaged = damage(dsn, lake, args.damage, seed=7)
    dry = measure("reconcile full --dry-run", lambda: reconcile(engine, dry_run=True))
    measure("reconcile full (repair)", lambda: reconcile(engine))
    clean = measure("reconcile full (clean)", lambda: reconcile(engine, dry_run=True))
    measure("reconcile incremental", lambda: reconcile(engine, mode="incremental"))

    print(f"\nmachine: {__import__('os').cpu_count()} cores; 1 run; {args.records:,} payments")
    print("damage:", damaged)
    print("\n" + format_report(dry))  # type: ignore[arg-type]
    print("\nsecond reconcile clean:", clean.clean)  # type: ignore[union-attr]
    print("\nvalidation suites (s):")
    for name, seconds in sorted(suite_times.items()):
        print(f"  {name:<40} {seconds:8.2f}")
    print(f"\n{'step':<28} {'wall s':>8} {'driver peak MB':>15}")
    for label, seconds, mb in rows:
        print(f"{label:<28} {seconds:8.1f} {mb:15.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
