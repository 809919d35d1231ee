"""The one safe way onceflow reads a Delta table on Spark without delta-spark.

A snapshot is read as its data files with the table's own schema: by Spark's Parquet reader on
a local lake, and by pyarrow on the executors on an object store (Spark's Hadoop filesystem has
no S3 connector here, and onceflow needs none).
That is exact only for tables without deletion vectors, column mapping or partition columns
(each needs the Delta log to read the files right); onceflow's own tables use none of them, and
a table that does is refused rather than misread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import DeltaTable

from onceflow.errors import UnsupportedTableError
from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

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


def open_table(where: Location | str, version: int | None = None) -> DeltaTable:
    """The Delta table at `where` (a location, or a folder or URI read with the environment's
    S3 settings), at `version` or the latest."""
    location = where if isinstance(where, Location) else Location.parse(where)
    return DeltaTable(location.uri, version=version, storage_options=location.delta_options())


def read_snapshot(
    spark: SparkSession,
    table: DeltaTable,
    where: Location | str,
    *,
    file_column: str | None = None,
    rows_after: tuple[str, int] | None = None,
) -> DataFrame:
    """The rows of `table`'s loaded version, read on the executors.

    Args:
        spark: The session to read with.
        table: The table, loaded at the version to read.
        where: The table's location (a string is a local folder), for messages and S3 access.
        file_column: When given, a column of that name holds each row's data file URI.
        rows_after: (column, value): the files whose statistics show no row with the column
            null or above the value are left out (the caller filters the rows themselves).

    Raises:
        UnsupportedTableError: The table uses a feature a plain Parquet read gets wrong.
    """
    from pyspark.sql import functions as F

    location = where if isinstance(where, Location) else Location.parse(where)
    check_readable(table, location.uri)
    schema = spark_schema(table)
    files = table.file_uris()
    if rows_after is not None and files:
        files = _files_after(table, files, *rows_after)
    if not files:
        empty = spark.createDataFrame([], schema)  # type: ignore[arg-type]
        if file_column:
            empty = empty.withColumn(file_column, F.lit(None).cast("string"))
        return empty
    if not location.is_local:
        return read_parquet_files(spark, location, files, schema, file_column=file_column)  # type: ignore[arg-type]
    frame = spark.read.schema(schema).parquet(*files)  # type: ignore[arg-type]
    if file_column:
        frame = frame.withColumn(file_column, F.col("_metadata.file_path"))
    return frame


def _files_after(table: DeltaTable, files: list[str], column: str, value: int) -> list[str]:
    """`files` but those whose statistics show every row's `column` not null and at most
    `value` (all of them when the log's file list does not line up with `files`)."""
    from urllib.parse import unquote

    actions = pa.table(table.get_add_actions(flatten=True))
    top, nulls = f"max.{column}", f"null_count.{column}"
    if top not in actions.column_names or nulls not in actions.column_names:
        return files
    paths = [unquote(p) for p in actions.column("path").to_pylist()]
    if len(paths) != len(files) or not all(
        f.endswith(p) for f, p in zip(files, paths, strict=True)
    ):
        return files
    tops, counts = actions.column(top).to_pylist(), actions.column(nulls).to_pylist()
    return [
        f
        for f, most, nulled in zip(files, tops, counts, strict=True)
        if most is None or nulled is None or nulled > 0 or most > value
    ]


def read_table(spark: SparkSession, path: Location | str, version: int | None = None) -> DataFrame:
    """Read the Delta table at `path` (its `version`, or the latest) on Spark."""
    return read_snapshot(spark, open_table(path, version), path)


def read_parquet_files(
    spark: SparkSession,
    location: Location,
    files: Sequence[str],
    schema: StructType,
    *,
    file_column: str | None = None,
) -> DataFrame:
    """The rows of Parquet `files` (URIs under `location`'s store), read by pyarrow on the
    executors as `schema`; with `file_column`, each row's file URI in that column."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StringType, StructField
    from pyspark.sql.types import StructType as Struct

    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    out = (
        Struct([*schema.fields, StructField(file_column, StringType())]) if file_column else schema
    )
    prefix = "s3://"

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fs = location.filesystem()
        for batch in batches:
            for uri in batch.column("uri").to_pylist():
                path = uri[len(prefix) :] if uri.startswith(prefix) else uri
                with fs.open_input_file(path) as handle:
                    for piece in pq.ParquetFile(handle).iter_batches(columns=arrow_schema.names):
                        rows = pa.Table.from_batches([piece]).cast(arrow_schema)
                        if file_column:
                            rows = rows.append_column(
                                file_column, pa.array([uri] * rows.num_rows, pa.string())
                            )
                        yield from rows.to_batches()

    listing = spark.createDataFrame([(f,) for f in files], "uri STRING")
    return listing.mapInArrow(read, out)
