"""The reference job `daily_totals`: the `payments` Delta table → per-day totals in PostgreSQL.

It shows one job feeding the next exactly once. Its source is the `payments` table read by
version: a window is a version range, added rows arrive with `_change` = +1 and rows a version
removed (a restatement, a repair) with `_change` = -1, so the totals follow the table's
current rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from onceflow.job import Job, WindowContext
from onceflow.sinks.postgres import PostgresSink
from onceflow.sources.delta import DeltaTableSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def daily_totals(changes: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    """Signed payment changes → what each (UTC day, currency) gains in total and count."""
    from pyspark.sql import functions as F

    sign = F.col("_change").cast("decimal(38,0)")
    return {
        "totals": changes.groupBy(F.to_date("created_at").alias("day"), F.col("currency")).agg(
            F.sum(F.col("amount_cents").cast("decimal(38,0)") * sign).alias("total_cents"),
            F.sum("_change").cast("bigint").alias("payment_count"),
        )
    }


DAILY_TOTALS = Job(
    name="daily_totals",
    description="Per-day, per-currency totals of the payments Delta table, exactly once.",
    source=DeltaTableSource(table="payments"),
    deterministic=True,
    transform=daily_totals,
    sinks=(
        PostgresSink(
            name="pg_daily_totals",
            output="totals",
            table="daily_totals",
            columns={
                "day": "date",
                "currency": "text",
                "total_cents": "numeric",
                "payment_count": "bigint",
            },
            key=("day", "currency"),
            mode="accumulate",
            accumulate=("total_cents", "payment_count"),
        ),
    ),
)
