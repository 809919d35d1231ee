"""A window's rows of a Delta table on executors: the frame's schema, and the Spark data source
`onceflow_delta_changes` reading one data file per partition as signed, positioned Arrow
batches (see `onceflow.sources.delta`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.errors import SourceError
from onceflow.sources._delta_log import _data_file_location, _filesystem, _source_name

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql.types import StructType

#: Columns the source adds after the table's own, in this order.
EXTRA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("_change", "INT"),
    ("_commit_version", "BIGINT"),
    ("_file_idx", "INT"),
    ("_source_file", "STRING"),
    ("_source_line", "BIGINT"),
    ("_reason", "STRING"),
    ("_raw_text", "STRING"),
)
#: Prefix given to a table column whose name is one of EXTRA_COLUMNS.
UPSTREAM_PREFIX = "_upstream"

# `_change_type` values of change data files, by the sign they give a row.
_CDC_PLUS = ("insert", "update_postimage")
_CDC_MINUS = ("delete", "update_preimage")
_BATCH_ROWS = 10_000


def _frame_schema(snapshot: DeltaTable) -> tuple[StructType, list[list[Any]]]:
    """The frame's Spark schema and, per table column, `[output name, table name, partition]`."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    arrow = pa.schema(snapshot.schema().to_arrow())
    partitions = set(snapshot.metadata().partition_columns)
    table_schema = from_arrow_schema(arrow)
    extras = {name for name, _ in EXTRA_COLUMNS}
    taken = set(arrow.names) | extras
    fields: list[StructField] = []
    layout: list[list[Any]] = []
    for spark_field in table_schema.fields:
        name = spark_field.name
        out = name
        while out in extras or (out != name and out in taken):
            out = UPSTREAM_PREFIX + out
        taken.add(out)
        # Nullable: a file written before a column existed has no values for it.
        fields.append(StructField(out, spark_field.dataType, True, spark_field.metadata))
        layout.append([out, name, name in partitions])
    spark_types = {"INT": IntegerType(), "BIGINT": LongType(), "STRING": StringType()}
    for name, ddl in EXTRA_COLUMNS:
        fields.append(StructField(name, spark_types[ddl], True))
    return StructType(fields), layout


# -- executors ------------------------------------------------------------------------------------


def _partition_array(value: str | None, target: pa.DataType, rows: int) -> pa.Array:
    """A column of `rows` copies of a partition value, parsed from the log's string form."""
    if value is None or (value == "" and not pa.types.is_string(target)):
        return pa.nulls(rows, target)
    text = pa.scalar(value, pa.string())
    if pa.types.is_timestamp(target) and target.tz is not None:
        try:
            scalar = text.cast(target)
        except pa.ArrowInvalid:
            # Delta writes UTC timestamps without an offset (`2024-01-02 03:04:05`).
            scalar = text.cast(pa.timestamp(target.unit)).cast(target)
    else:
        scalar = text.cast(target)
    return pa.repeat(scalar, rows)


def _signs(change_types: pa.Array, path: str) -> pa.Array:
    """+1/-1 per row of a change data file, from its `_change_type` column."""
    import pyarrow.compute as pc

    plus = pc.is_in(change_types, value_set=pa.array(_CDC_PLUS, pa.string()))
    minus = pc.is_in(change_types, value_set=pa.array(_CDC_MINUS, pa.string()))
    if not pc.all(pc.or_(plus, minus)).as_py():
        unknown = pc.unique(pc.filter(change_types, pc.invert(pc.or_(plus, minus))))
        raise SourceError(
            f"change data file {path} holds `_change_type` values {unknown.to_pylist()}, which "
            "are not Delta change types; repair the upstream table's change data"
        )
    return pc.if_else(plus, pa.scalar(1, pa.int32()), pa.scalar(-1, pa.int32()))


def _read_data_file(
    root: str,
    file_idx: int,
    entry: list[Any],
    layout: list[list[Any]],
    target: pa.Schema,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches of one data file in the frame's schema, with its signs and positions."""
    import pyarrow.parquet as pq

    version, log_path, change, partition_values = entry
    fs, base = _filesystem(root)
    file_fs, location = _data_file_location(fs, base, log_path)
    source = _source_name(version, log_path)
    line = 1
    with file_fs.open_input_file(location) as handle:
        parquet = pq.ParquetFile(handle)
        present = set(parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
            rows = batch.num_rows
            if rows == 0:
                continue
            arrays: list[pa.Array] = []
            for (out, name, is_partition), target_field in zip(layout, target, strict=False):
                assert target_field.name == out
                if is_partition:
                    arrays.append(
                        _partition_array(partition_values.get(name), target_field.type, rows)
                    )
                elif name in present:
                    arrays.append(batch.column(name).cast(target_field.type))
                else:
                    arrays.append(pa.nulls(rows, target_field.type))
            if change == 0:
                arrays.append(_signs(batch.column("_change_type").cast(pa.string()), log_path))
            else:
                arrays.append(pa.repeat(pa.scalar(change, pa.int32()), rows))
            arrays.append(pa.repeat(pa.scalar(version, pa.int64()), rows))
            arrays.append(pa.repeat(pa.scalar(file_idx, pa.int32()), rows))
            arrays.append(pa.repeat(pa.scalar(source, pa.string()), rows))
            arrays.append(pa.array(range(line, line + rows), pa.int64()))
            arrays.append(pa.nulls(rows, pa.string()))
            arrays.append(pa.nulls(rows, pa.string()))
            line += rows
            yield pa.RecordBatch.from_arrays(arrays, schema=target)


class DeltaFilePartition(InputPartition):
    """One data file of a window, read by one Spark task."""

    def __init__(self, index: int, entry: list[Any]) -> None:
        super().__init__(index)
        self.index = index
        self.entry = entry


class _DeltaChangesReader(DataSourceReader):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.root = options["root"]
        self.layout: list[list[Any]] = json.loads(options["layout"])
        self.files: list[list[Any]] = json.loads(options["files"])
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        return [DeltaFilePartition(i, entry) for i, entry in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from pyspark.sql.pandas.types import to_arrow_schema

        assert isinstance(partition, DeltaFilePartition)
        # The exact Arrow schema pyspark checks batches against.
        target = to_arrow_schema(self.schema, timezone="UTC")
        yield from _read_data_file(self.root, partition.index, partition.entry, self.layout, target)


class _DeltaChangesDataSource(DataSource):
    """Spark data source `onceflow_delta_changes`: one partition per data file, signed rows."""

    @classmethod
    def name(cls) -> str:
        return "onceflow_delta_changes"

    def schema(self) -> StructType:
        from pyspark.sql.types import StructType

        return StructType.fromJson(json.loads(self.options["schema"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _DeltaChangesReader(dict(self.options), schema)
