"""The one safe way onceflow reads a Delta table on Spark without delta-spark.

A snapshot is read as its data files with Spark's Parquet reader and the table's own schema.
That is exact only for tables without deletion vectors, column mapping or partition columns
(each needs the Delta log to read the files right); onceflow's own tables use none of them, and
a table that does is refused rather than misread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import DeltaTable

from onceflow.errors import UnsupportedTableError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The column `read_snapshot(..., file_column=...)` adds: the URI of each row's data file.
_UNSUPPORTED = frozenset({"deletionVectors", "columnMapping"})


def check_readable(table: DeltaTable, where: str) -> None:
    """Raise UnsupportedTableError if a plain Parquet read would get `table` wrong."""
    protocol = table.protocol()
    features = set(protocol.reader_features or ()) | set(protocol.writer_features or ())
    problems = sorted(features & _UNSUPPORTED)
    mode = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mode != "none" and "columnMapping" not in problems:
        problems.append("columnMapping")
    if table.metadata().partition_columns:
        problems.append("partition columns")
    if problems:
        raise UnsupportedTableError(
            f"Delta table {where} uses {', '.join(problems)}, which onceflow does not read; "
            "point the job at a table without them (or rewrite the table without them)."
        )


def spark_schema(table: DeltaTable) -> object:
    """The table's schema as a Spark StructType."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(pa.schema(table.schema().to_arrow()))


def read_snapshot(
    spark: SparkSession, table: DeltaTable, where: str, *, file_column: str | None = None
) -> DataFrame:
    """The rows of `table`'s loaded version, read on the executors.

    Args:
        spark: The session to read with.
        table: The table, loaded at the version to read.
        where: The table's path, for messages.
        file_column: When given, a column of that name holds each row's data file URI.

    Raises:
        UnsupportedTableError: The table uses a feature a plain Parquet read gets wrong.
    """
    from pyspark.sql import functions as F

    check_readable(table, where)
    schema = spark_schema(table)
    files = table.file_uris()
    if not files:
        empty = spark.createDataFrame([], schema)  # type: ignore[arg-type]
        if file_column:
            empty = empty.withColumn(file_column, F.lit(None).cast("string"))
        return empty
    frame = spark.read.schema(schema).parquet(*files)  # type: ignore[arg-type]
    if file_column:
        frame = frame.withColumn(file_column, F.col("_metadata.file_path"))
    return frame


def read_table(spark: SparkSession, path: str, version: int | None = None) -> DataFrame:
    """Read the Delta table at `path` (its `version`, or the latest) on Spark."""
    return read_snapshot(spark, DeltaTable(path, version=version), path)
