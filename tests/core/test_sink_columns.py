"""A PostgreSQL sink's table against its declared columns (`sinks/postgres/_columns.py`): each
problem named with the SQL that fixes it, found without waiting on writers' locks."""

from __future__ import annotations

import psycopg

from onceflow.sinks.postgres._columns import table_problems
from onceflow.sinks.postgres.spec import PostgresSink

ORDERS = PostgresSink(
    name="pg_orders",
    output="orders",
    table="orders",
    columns={"order_id": "text", "amount_cents": "bigint"},
    key=("order_id",),
    mode="upsert",
)


def test_a_retyped_column_and_a_missing_key_are_named_with_their_fix(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.orders (order_id text, amount_cents boolean)")
        problems = table_problems(conn, ORDERS)
    assert len(problems) == 2, problems
    assert "column amount_cents of table public.orders is boolean" in problems[0]
    assert 'ALTER COLUMN "amount_cents" TYPE bigint' in problems[0]
    assert 'ADD PRIMARY KEY ("order_id")' in problems[1]


def test_a_fitting_table_passes_while_a_writer_holds_a_lock_on_it(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.orders (order_id text PRIMARY KEY, amount_cents bigint)")
    with psycopg.connect(pg_dsn) as writer, psycopg.connect(pg_dsn, autocommit=True) as conn:
        writer.execute("LOCK TABLE public.orders IN SHARE MODE")
        # Planning an insert into the table itself would wait for the lock.
        conn.execute("SET lock_timeout = '2s'")
        assert table_problems(conn, ORDERS) == []
        assert (
            conn.execute("SELECT count(*) FROM pg_class WHERE relpersistence = 't'").fetchone()[0]
            == 0
        ), "the probe table outlived the check"
        writer.rollback()
