"""What a PostgreSQL sink's table should hold, from the windows' recomputed rows, as its mode
leaves them (append: every row; upsert: each key's latest; accumulate: each key's sums), for
reconcile to compare with the table."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from functools import reduce
from typing import TYPE_CHECKING

from onceflow._pgcopy import POSITION
from onceflow.sinks.postgres.spec import PostgresSink, spark_schema
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def expected_rows(
    spark: SparkSession,
    spec: PostgresSink,
    expected: DataFrame | None,
    windows: AbstractSet[int],
    *,
    keep_window: bool,
    base: DataFrame | None = None,
) -> DataFrame:
    """The rows `spec`'s table should hold for `windows`, from `expected` (rows plus
    `WINDOW_COL`; None: none), cast to the table's columns; `keep_window` keeps `WINDOW_COL`;
    `base`: an accumulating sink's verified rows, added before every window."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import _parse_datatype_string

    schema = _parse_datatype_string(spark_schema(spec.columns))
    accumulate = spec.mode == "accumulate"
    if expected is None:
        expected = spark.createDataFrame([], schema).withColumn(
            WINDOW_COL, F.lit(None).cast("bigint")
        )
    expected = expected.where(F.col(WINDOW_COL).isin(sorted(windows)) if windows else F.lit(False))
    if base is not None:
        # An accumulating sink's verified state (`_baseline`), before every window after it.
        typed = [F.col(f.name).cast(f.dataType) for f in schema.fields]
        expected = expected.select(*typed, WINDOW_COL).unionByName(
            base.select(*typed).withColumn(WINDOW_COL, F.lit(0).cast("bigint"))
        )
    if accumulate:
        others = [c for c in spec.columns if c not in spec.key and c not in spec.accumulate]
        expected = expected.groupBy(*spec.key).agg(
            *[F.sum(F.col(c).cast("decimal(38,0)")).alias(c) for c in spec.accumulate],
            *[F.max_by(F.col(c), F.col(WINDOW_COL)).alias(c) for c in others],
        )
        # The sink deletes a row whose accumulated columns all come back to zero.
        expected = expected.where(
            reduce(lambda a, b: a | b, [F.col(c) != 0 for c in spec.accumulate])
        )
    elif spec.mode == "upsert":
        # A key updated by a later window holds only that window's row; with `order_by`,
        # the row of the greatest value, a tie to the later window, file and line (as
        # `apply_staged` picks it).
        from pyspark.sql import Window as W

        order = [F.col(WINDOW_COL).desc()]
        if spec.order_by is not None:
            order = [F.col(spec.order_by).desc_nulls_last(), *order]
            order += [F.col(c).desc_nulls_last() for c in POSITION if c in expected.columns]
        latest = W.partitionBy(*spec.key).orderBy(*order)
        expected = (
            expected.withColumn("__latest", F.row_number().over(latest))
            .where(F.col("__latest") == 1)
            .drop("__latest")
        )
    expected = expected.select(
        *[F.col(f.name).cast(f.dataType) for f in schema.fields],
        *([F.col(WINDOW_COL)] if keep_window else []),
    )
    return expected
