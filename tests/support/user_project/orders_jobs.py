"""A user's job, written the way a user writes one: orders from CSV files into PostgreSQL.

It lives outside the onceflow package; onceflow finds it through `ONCEFLOW_JOBS=orders_jobs`
or the `[tool.onceflow]` table of the `pyproject.toml` next to it.
"""

from __future__ import annotations

from onceflow import CsvSource, Job, PostgresSink, quarantine_table


def orders(rows, ctx):
    from pyspark.sql import functions as F

    return {
        "orders": rows.select(
            "order_id",
            F.lower(F.trim("customer")).alias("customer"),
            "amount_cents",
            "ordered_at",
            F.lit(ctx.window_id).cast("bigint").alias("window_id"),
        )
    }


ORDERS = Job(
    name="orders",
    source=CsvSource(
        "orders",
        schema={
            "order_id": "string",
            "customer": "string",
            "amount_cents": "bigint",
            "ordered_at": "timestamp",
        },
    ),
    transform=orders,
    sinks=(
        PostgresSink(
            name="pg_orders",
            output="orders",
            table="orders",
            columns={
                "order_id": "text",
                "customer": "text",
                "amount_cents": "bigint",
                "ordered_at": "timestamptz",
                "window_id": "bigint",
            },
            key=("order_id",),
            mode="upsert",
            window_column="window_id",
        ),
        quarantine_table("orders_quarantine"),
    ),
    quarantine_sink="orders_quarantine",
)
