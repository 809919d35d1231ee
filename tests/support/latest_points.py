"""A user's upsert job for the tests: the latest points of each team, the latest window's row
winning, so windows bring new keys and keys the table holds."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import Job, ParquetSource, PostgresSink, WindowContext


def _latest(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return {
        "latest": rows.select(
            "team", "points", F.lit(ctx.window_id).cast("bigint").alias("_window_id")
        )
    }


def latest_points_job(schema: Mapping[str, str]) -> Job:
    """The job over Parquet files of `schema` (with `team` and `points`) in folder `scores`,
    into the PostgreSQL table `latest_points` (sink `pg_latest`, keyed by team)."""
    return Job(
        name="latest_points",
        source=ParquetSource("scores", schema=dict(schema)),
        transform=_latest,
        sinks=(
            PostgresSink(
                "pg_latest", "latest", table="latest_points",
                columns={"team": "text", "points": "bigint", "_window_id": "bigint"},
                key=("team",), mode="upsert", window_column="_window_id",
            ),
        ),
    )  # fmt: skip
