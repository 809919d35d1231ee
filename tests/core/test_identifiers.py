"""Spark SQL text from `onceflow._identifiers`: names and strings reach Spark as they were."""

from __future__ import annotations

from typing import Any

import pytest

from onceflow._identifiers import spark_sql_name, spark_sql_string

AWKWARD = [
    "plain",
    "with space",
    "back`tick",
    "``",
    "quote's",
    'double"',
    "back\\slash",
    "é 支付",
    "",
]


@pytest.mark.parametrize("value", AWKWARD)
def test_a_string_literal_is_the_string(spark: Any, value: str) -> None:
    [row] = spark.range(1).selectExpr(f"{spark_sql_string(value)} AS s").collect()
    assert row["s"] == value


def test_a_quoted_name_is_the_column_of_that_name(spark: Any) -> None:
    names = [n for n in AWKWARD if n]
    df = spark.createDataFrame([tuple(range(len(names)))], [*names])
    picked = df.selectExpr(
        *(f"{spark_sql_name(n)} + 100 AS {spark_sql_name(n)}" for n in reversed(names))
    )
    assert picked.columns == list(reversed(names))
    assert list(picked.collect()[0]) == [100 + i for i in reversed(range(len(names)))]
    # A dedupe key of awkward column names: first occurrence per key, as compute orders it.
    rows = spark.createDataFrame(
        [("a", 1, 2), ("a", 1, 1), ("b", 1, 3)], ["with space", "back`tick", "pos"]
    )
    partition = ", ".join(spark_sql_name(k) for k in ("with space", "back`tick"))
    first = rows.selectExpr(
        "*", f"row_number() OVER (PARTITION BY {partition} ORDER BY pos) AS n"
    ).where("n = 1")
    assert sorted((r["with space"], r["pos"]) for r in first.collect()) == [("a", 1), ("b", 3)]
