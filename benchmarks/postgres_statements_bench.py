"""Benchmark: three PostgreSQL choices of the commit path, each against its alternative.

On the embedded server (`pgserver`), medians of `--repeat` rounds after one warm-up round,
the two sides alternating:

- an accumulating sink's window (10,000 keys in random order, 98 % already in a 50,000-row
  table with a primary key on the sink's key) added by onceflow's `_accumulate`: by one
  `INSERT … ON CONFLICT DO UPDATE`, and by the path a table without a unique key takes (a
  temporary table of the sums, an update, an insert), forced on a twin table;
- an upsert of 19,000 new random keys into a 400,000-row table, the rows in key order or as
  staged;
- a ledger-sized read (one indexed row) on a new session each time, as before
  `onceflow.postgres.Sessions`, or on a kept one;
- an accumulating sink's window contribution (10,000 staged rows of about 8,000 keys) recorded
  by onceflow's `_save_contribution`, one row a window, or as versions before kept it, a row
  per key;
- an accumulating sink's whole window as the commit applies it (the sums added into a
  50,000-row table and the window's contribution recorded): by one statement grouping the
  staged rows once (`_accumulate(…, record=…)`), or by two that group them each.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:7.1f} ms"


def _alternate(rounds: int, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each side returns the seconds it measured; the first round warms the caches."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(rounds + 1):
        for name, run in sides.items():
            seconds = run()
            if i:
                times[name].append(seconds)
    return times


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _balance_twins(
    conn: psycopg.Connection, tables: tuple[str, str], stage: str
) -> tuple[dict[str, Any], sql.Identifier]:
    """The `payments` job's balances sink in two twin tables of 50,000 rows (primary key on the
    sink's key), each a sink of its own name, and an empty staging table `stage` as the commit
    stages rows (accumulated columns numeric)."""
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.sinks.postgres import _markers
    from onceflow.sinks.postgres.group import _create_table

    balances = PAYMENTS.sink("pg_merchant_balances")
    twins = {t: dataclasses.replace(balances, name=t, table=t) for t in tables}
    _markers.create_protocol_tables(conn)
    for table, spec in twins.items():
        _create_table(conn, spec)
        conn.execute(
            sql.SQL(
                "INSERT INTO {} SELECT 'm' || g, 'EUR', 100, 1 FROM generate_series(1, 50000) g"
            ).format(sql.Identifier(table))
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
    conn.execute(
        sql.SQL(
            "CREATE UNLOGGED TABLE {} (merchant_id text, currency text,"
            " total_cents numeric, payment_count numeric)"
        ).format(sql.Identifier(stage))
    )
    return twins, sql.Identifier("public", stage)


def accumulate(dsn: str, rounds: int) -> dict[str, list[float]]:
    from onceflow.sinks.postgres import _accumulate as commit

    with psycopg.connect(dsn, autocommit=True) as conn:
        twins, staging = _balance_twins(conn, ("bal_upsert", "bal_update"), "bal_stage")
        # Keys in random order, as a window's merchants come.
        conn.execute(
            "INSERT INTO bal_stage SELECT 'm' || (g * 5), 'EUR', 7, 1"
            " FROM generate_series(1, 9800) g ORDER BY random()"
        )
        conn.execute(
            "INSERT INTO bal_stage SELECT 'new' || g, 'EUR', 7, 1 FROM generate_series(1, 200) g"
        )
    work = psycopg.connect(dsn)

    def add(table: str, upsert: bool) -> Callable[[], float]:
        target = twins[table]

        def run() -> None:
            # The two-statement path is the one a table without a unique key takes; here it is
            # forced on a table like the other, so only the statements differ.
            unique = commit._key_is_unique
            if not upsert:
                commit._key_is_unique = lambda conn, spec: False
            try:
                commit.accumulate(work, target, commit.summed(target, staging))
            finally:
                commit._key_is_unique = unique
            work.commit()

        return lambda: _timed(run)

    try:
        return _alternate(
            rounds,
            {
                "one upsert": add("bal_upsert", upsert=True),
                "temp table, update, insert": add("bal_update", upsert=False),
            },
        )
    finally:
        work.close()


def upsert_order(dsn: str, rounds: int) -> dict[str, list[float]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE pay (payment_id text PRIMARY KEY, merchant_id text, amount bigint,"
            " w bigint)"
        )
        conn.execute(
            "INSERT INTO pay SELECT md5(g::text), 'm' || (g % 5000), g, 0"
            " FROM generate_series(1, 400000) g"
        )
        conn.execute("VACUUM ANALYZE pay")
    counter = [0]

    def run(order: sql.Composable) -> Callable[[], float]:
        def once() -> float:
            counter[0] += 1
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP TABLE IF EXISTS pay_stage")
                conn.execute(
                    "CREATE UNLOGGED TABLE pay_stage AS SELECT md5(random()::text) AS payment_id,"
                    " 'm' || (g %% 5000) AS merchant_id, g::bigint AS amount, %s::bigint AS w"
                    " FROM generate_series(1, 19000) g",
                    (counter[0],),
                )
                upsert = sql.SQL(
                    "INSERT INTO pay AS t SELECT * FROM pay_stage{} ON CONFLICT (payment_id)"
                    " DO UPDATE SET amount = EXCLUDED.amount WHERE t.w <= EXCLUDED.w"
                ).format(order)
                return _timed(lambda: conn.execute(upsert))

        return once

    return _alternate(
        rounds,
        {"in key order": run(sql.SQL(" ORDER BY payment_id")), "as staged": run(sql.SQL(""))},
    )


def sessions(dsn: str, rounds: int) -> dict[str, list[float]]:
    from onceflow.postgres import Sessions

    reads = 50
    kept = Sessions(dsn)

    def read(conn: psycopg.Connection) -> None:
        conn.execute("SELECT payment_id FROM pay WHERE payment_id = md5('7')").fetchone()

    def new_each_time() -> float:
        started = time.perf_counter()
        for _ in range(reads):
            with Sessions(dsn).session(autocommit=True) as conn:
                read(conn)
        return time.perf_counter() - started

    def reused() -> float:
        started = time.perf_counter()
        with kept.kept():
            for _ in range(reads):
                with kept.session(autocommit=True) as conn:
                    read(conn)
        return time.perf_counter() - started

    times = _alternate(rounds, {"a new session each": new_each_time, "kept sessions": reused})
    return {name: [t / reads for t in samples] for name, samples in times.items()}


def contributions(dsn: str, rounds: int) -> dict[str, list[float]]:
    from onceflow.jobs.payments import PAYMENTS
    from onceflow.sinks.postgres import _accumulate as commit
    from onceflow.sinks.postgres import _markers

    balances = PAYMENTS.sink("pg_merchant_balances")
    staging = sql.Identifier("public", "contribution_stage")
    with psycopg.connect(dsn, autocommit=True) as conn:
        _markers.create_protocol_tables(conn)
        conn.execute(
            "CREATE UNLOGGED TABLE contribution_stage (merchant_id text, currency text,"
            " total_cents numeric, payment_count numeric)"
        )
        conn.execute(
            "INSERT INTO contribution_stage SELECT 'm' || (random() * 5000)::int,"
            " (ARRAY['EUR', 'USD', 'GBP', 'JPY', 'CHF'])[1 + (random() * 4)::int],"
            " (random() * 1e7)::bigint - 1000000, 1 FROM generate_series(1, 10000)"
        )
    # The statement versions before this one ran (with the delete of the window's rows).
    per_key = sql.SQL(
        "DELETE FROM onceflow.contributions WHERE job = 'bench' AND sink = {sink}"
        " AND window_id = {w};"
        " INSERT INTO onceflow.contributions (job, sink, window_id, key, amounts)"
        " SELECT 'bench', {sink}, {w}, jsonb_build_array(merchant_id, currency),"
        " jsonb_build_array(sum(total_cents::numeric), sum(payment_count::numeric))"
        " FROM {stage} AS r GROUP BY merchant_id, currency"
    )
    work = psycopg.connect(dsn)
    window = [0]

    def record(one_row: bool) -> Callable[[], float]:
        def run() -> None:
            window[0] += 1
            if one_row:
                commit.save_contribution(work, balances, staging, "bench", window[0])
            else:
                work.execute(
                    per_key.format(
                        sink=sql.Literal(balances.name), w=sql.Literal(window[0]), stage=staging
                    )
                )
            work.commit()

        return lambda: _timed(run)

    try:
        return _alternate(
            rounds, {"one row a window": record(True), "a row per key": record(False)}
        )
    finally:
        work.close()


def accumulate_and_record(dsn: str, rounds: int) -> dict[str, list[float]]:
    from onceflow.sinks.postgres import _accumulate as commit

    with psycopg.connect(dsn, autocommit=True) as conn:
        twins, staging = _balance_twins(conn, ("acc_one", "acc_two"), "acc_stage")
        conn.execute(
            "INSERT INTO acc_stage SELECT 'm' || (random() * 50000)::int, 'EUR',"
            " (random() * 1e5)::bigint, 1 FROM generate_series(1, 10000)"
        )
    work = psycopg.connect(dsn)
    window = [0]

    def apply(one_statement: bool) -> Callable[[], float]:
        def run() -> None:
            window[0] += 1
            if one_statement:
                spec = twins["acc_one"]
                commit.forget_contribution(work, spec, "bench", window[0])
                commit.accumulate(
                    work, spec, commit.summed(spec, staging), record=("bench", window[0])
                )
            else:
                spec = twins["acc_two"]
                commit.save_contribution(work, spec, staging, "bench", window[0])
                commit.accumulate(work, spec, commit.summed(spec, staging))
            work.commit()

        return lambda: _timed(run)

    try:
        return _alternate(
            rounds, {"one statement, grouped once": apply(True), "two statements": apply(False)}
        )
    finally:
        work.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args(argv)
    import pgserver

    work = Path(tempfile.mkdtemp(prefix="onceflow-pgbench-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    try:
        dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        for title, bench in (
            ("accumulate a 10,000-key window into 50,000 rows", accumulate),
            ("upsert 19,000 new random keys into 400,000 rows", upsert_order),
            ("one ledger read (per read, session included)", sessions),
            ("record a window's contribution (10,000 staged rows)", contributions),
            ("accumulate and record a window (10,000 staged rows)", accumulate_and_record),
        ):
            print(title)
            for name, samples in bench(dsn, args.repeat).items():
                print(f"  {name:<46} {_median_ms(samples)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
