"""Which expressions vary from one computation of a window to the next, on real Spark."""

from __future__ import annotations

from pyspark.sql import functions as F

from onceflow._varying import varying


def test_rows_computed_from_their_input_alone_vary_in_nothing(spark) -> None:
    rows = spark.range(10).withColumn("k", F.col("id") % 3)
    totals = rows.groupBy("k").agg(F.sum("id").alias("total"))
    hashed = rows.join(totals, "k").withColumn("s", F.sha2(F.col("k").cast("string"), 256))
    assert varying(hashed) == []
    assert varying(rows.withColumn("u", F.udf(lambda v: v * 2, "bigint")("id"))) == []


def test_random_ids_nondeterministic_udfs_and_the_clock_are_named(spark) -> None:
    rows = spark.range(10)
    assert varying(rows.withColumn("r", F.rand(7))) == ["rand()"]
    assert varying(rows.withColumn("u", F.expr("uuid()"))) == ["uuid()"]
    assert varying(rows.withColumn("m", F.monotonically_increasing_id())) == [
        "monotonically_increasing_id()"
    ]
    drawn = F.udf(lambda v: v, "bigint").asNondeterministic()
    assert len(varying(rows.withColumn("d", drawn("id")))) == 1
    assert varying(rows.withColumn("t", F.current_timestamp())) == ["current_timestamp()"]
    assert varying(rows.where(F.current_date() > F.lit("2020-01-01"))) == ["current_date()"]
    # Inside an aggregate, a join's other side, a filter: found wherever it is.
    other = rows.select("id", (F.rand() * 10).alias("x")).groupBy().agg(F.max("x").alias("x"))
    assert varying(rows.crossJoin(other)) == ["rand()"]
