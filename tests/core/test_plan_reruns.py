"""Which physical plans keep results of their first execution, and which planning ran Spark
jobs, on real Spark."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import functions as F

from onceflow._plan_reruns import jobs_started, kept_once, reruns_afresh


def _rows(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"k": [i % 3 for i in range(12)], "v": list(range(12))})


def test_a_read_and_its_steps_in_one_partition_run_afresh(spark) -> None:
    rows = spark.range(0, 1, 1, 1).mapInArrow(_rows, "k long, v long")
    # A single partition already meets a grouping's distribution: no shuffle.
    assert reruns_afresh(rows.where("v > 2").select("k"))
    assert reruns_afresh(rows.groupBy("k").agg(F.sum("v").alias("v")))
    # Joined with its own aggregate, Spark broadcasts the small side all the same.
    top = rows.groupBy("k").agg(F.max("v").alias("top"))
    assert kept_once(rows.join(top, "k")) == ["BroadcastExchange"]


def test_shuffles_broadcasts_and_subqueries_are_found_wherever_they_are(spark) -> None:
    rows = spark.range(0, 2, 1, 2).mapInArrow(_rows, "k long, v long")
    assert "Exchange" in kept_once(rows.groupBy("k").count())
    assert "Exchange" in kept_once(rows.repartition(3))
    top = rows.groupBy("k").agg(F.max("v").alias("top"))
    assert "BroadcastExchange" in kept_once(rows.join(F.broadcast(top), "k"))
    rows.createOrReplaceTempView("plan_reruns_rows")
    below_max = spark.sql(
        "SELECT * FROM plan_reruns_rows WHERE v < (SELECT max(v) FROM plan_reruns_rows)"
    )
    assert any("Subquery" in name for name in kept_once(below_max))
    # Inside a cached relation's plan: the cache is filled from that plan again.
    cached = rows.repartition(2).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        assert "Exchange" in kept_once(cached.select("k"))
    finally:
        cached.unpersist()


def test_jobs_started_counts_this_threads_jobs_and_gives_its_group_back(spark) -> None:
    context = spark.sparkContext
    rows = spark.range(0, 1, 1, 1).mapInArrow(_rows, "k long, v long")
    context.setJobGroup("callers-group", "the caller's")
    try:
        with jobs_started(spark) as planned_only:
            rows.groupBy("k").count().where("count > 1")
        with jobs_started(spark) as counted:
            rows.count()
        assert (planned_only(), counted()) == (0, 1)
        assert context.getLocalProperty("spark.jobGroup.id") == "callers-group"
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
        context.setLocalProperty("spark.job.description", None)
        context.setLocalProperty("spark.job.interruptOnCancel", None)
