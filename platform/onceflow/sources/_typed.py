"""What typed landing sources (CSV, Parquet) share: the declared schema, the frame, the rows.

A typed source's frame is

    _file_idx INT, _source_file STRING, _source_line BIGINT, <declared columns>, _reason STRING,
    _raw_text STRING

with every declared column null on an invalid record, `_reason` naming the column and the
problem, and `_raw_text` holding the record as text for the quarantine.

The value rules for text (a CSV field, or a Parquet string column declared with another type)
and the column types are in `onceflow.sources._values`. Besides them, a column the source
declares `required` must hold a value: null, empty or only spaces and tabs makes the record
invalid (`<column>: required, but empty`), never a `""` key.

With `raw_text` (a job that has a `parse` step on the typed source), `_raw_text` holds every
record's text, valid ones too, so a record the parse rejects keeps it in the quarantine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from onceflow._identifiers import check_identifier
from onceflow.errors import ConfigurationError
from onceflow.sources._values import (
    _TRIM,
    MAX_TIMESTAMP_US,
    MIN_TIMESTAMP_US,
    ColumnType,
    Invalid,
    TextConverter,
    parse_type,
    text_converter,
)

__all__ = [
    "MAX_REASON_CHARS",
    "MAX_TIMESTAMP_US",
    "MIN_TIMESTAMP_US",
    "POSITION_FIELDS",
    "REQUIRED_PROBLEM",
    "ColumnType",
    "Invalid",
    "RowBuffer",
    "Schema",
    "TextConverter",
    "arrow_schema",
    "cap_reason",
    "check_folder",
    "check_required",
    "is_empty",
    "normalise_schema",
    "parse_type",
    "quarantine_text",
    "read_typed",
    "spark_struct",
    "text_converter",
    "typed_columns_batch",
]

#: The longest `_reason` a typed source writes; longer reasons are cut with "…".
MAX_REASON_CHARS = 200


class Schema(Mapping[str, str]):
    """A declared schema: column name → Spark SQL type, in order, immutable and hashable.

    It reads like the mapping it was built from (`schema["amount"] == "decimal(12,2)"`, types in
    their canonical spelling) so a source stays plain, comparable job data.
    """

    __slots__ = ("_pairs", "_types")

    def __init__(self, pairs: Sequence[tuple[str, ColumnType]]) -> None:
        self._pairs: tuple[tuple[str, str], ...] = tuple((n, t.sql) for n, t in pairs)
        self._types: tuple[tuple[str, ColumnType], ...] = tuple(pairs)

    @property
    def columns(self) -> tuple[tuple[str, ColumnType], ...]:
        """`(name, type)` pairs in declared order."""
        return self._types

    def __getitem__(self, key: str) -> str:
        for name, sql in self._pairs:
            if name == key:
                return sql
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Schema):
            return self._pairs == other._pairs
        if isinstance(other, Mapping):
            return dict(self._pairs) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(dict(self._pairs))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_schema_from_pairs, (self._pairs,))

    def to_json(self) -> str:
        """The schema as a JSON list of `[name, type]` pairs (a Spark option value)."""
        return json.dumps([list(p) for p in self._pairs])

    @classmethod
    def from_json(cls, text: str) -> Schema:
        """The inverse of `to_json`."""
        return normalise_schema([tuple(p) for p in json.loads(text)], "schema")


def _schema_from_pairs(pairs: tuple[tuple[str, str], ...]) -> Schema:
    return normalise_schema(pairs, "schema")


def normalise_schema(value: Any, owner: str) -> Schema:
    """Check a declared schema and return it as a `Schema`.

    Args:
        value: A mapping of column name → type (or a sequence of `(name, type)` pairs).
        owner: Who declares it (`CsvSource('payments')`), for error messages.

    Raises:
        ConfigurationError: The schema is empty, a name is not a plain identifier, starts with
            `_`, repeats (ignoring case, as Spark does), or a type is unknown.
    """
    if isinstance(value, Schema):
        return value
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value
    ):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise ConfigurationError(
            f"{owner}: schema must be a mapping of column name to type, such as "
            "{'payment_id': 'string', 'amount': 'decimal(12,2)'}."
        )
    if not pairs:
        raise ConfigurationError(
            f"{owner}: schema is empty; declare at least one column, such as "
            "{'payment_id': 'string'}."
        )
    seen: dict[str, str] = {}
    columns: list[tuple[str, ColumnType]] = []
    for name, type_text in pairs:
        if not isinstance(name, str):
            raise ConfigurationError(f"{owner}: column name {name!r} must be a string.")
        check_identifier(name, f"{owner}: column")
        if name.startswith("_"):
            raise ConfigurationError(
                f"{owner}: column {name!r} starts with '_', which is reserved for onceflow's "
                "own columns (_source_file, _reason, …); rename it."
            )
        folded = name.lower()
        if folded in seen:
            raise ConfigurationError(
                f"{owner}: columns {seen[folded]!r} and {name!r} differ only in case; Spark "
                "treats them as one column. Rename one."
            )
        seen[folded] = name
        columns.append((name, parse_type(type_text, name)))
    return Schema(columns)


REQUIRED_PROBLEM = "required, but empty"


def check_required(required: Any, schema: Schema, owner: str) -> tuple[str, ...]:
    """Check the columns a typed source declares required; return them as a tuple.

    Raises:
        ConfigurationError: One is not a column of the schema.
    """
    if isinstance(required, str):
        required = (required,)
    if not isinstance(required, (list, tuple)) or not all(isinstance(c, str) for c in required):
        raise ConfigurationError(
            f"{owner}: required must name columns of the schema, such as ('order_id',)."
        )
    for column in required:
        if column not in schema:
            raise ConfigurationError(
                f"{owner}: required column {column!r} is not in the schema ({list(schema)})."
            )
    return tuple(dict.fromkeys(required))


def is_empty(value: Any) -> bool:
    """Whether a converted value counts as no value for a required column."""
    return value is None or (isinstance(value, str) and not value.strip(_TRIM))


def check_folder(folder: Any, suffix: Any, owner: str) -> None:
    """Check a landing source's folder and suffix.

    Args:
        folder: The folder under the landing root.
        suffix: The file-name ending of input files.
        owner: Who declares them (`CsvSource('payments')`), for error messages.

    Raises:
        ConfigurationError: Either is empty or not a string.
    """
    if not isinstance(folder, str) or not folder.strip("/"):
        raise ConfigurationError(
            f"{owner}: folder must be a non-empty path under the landing root."
        )
    if not isinstance(suffix, str) or not suffix:
        raise ConfigurationError(
            f"{owner}: suffix must be a non-empty file-name ending, such as '.csv'."
        )


POSITION_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("_file_idx", pa.int32()),
    ("_source_file", pa.string()),
    ("_source_line", pa.int64()),
)


def arrow_schema(schema: Schema) -> pa.Schema:
    """The Arrow schema of a typed source's batches (what Spark checks them against)."""
    return pa.schema(
        [
            *POSITION_FIELDS,
            *((name, ctype.arrow()) for name, ctype in schema.columns),
            ("_reason", pa.string()),
            ("_raw_text", pa.string()),
        ]
    )


def spark_struct(schema: Schema) -> Any:
    """The Spark `StructType` of a typed source's frame.

    Built from type objects, not parsed from DDL: parsing needs a JVM, which neither a Spark
    Connect client nor a Python worker has.
    """
    from pyspark.sql import types as T

    simple: dict[str, T.DataType] = {
        "string": T.StringType(),
        "bigint": T.LongType(),
        "int": T.IntegerType(),
        "double": T.DoubleType(),
        "boolean": T.BooleanType(),
        "date": T.DateType(),
        "timestamp": T.TimestampType(),
    }

    def spark_type(ctype: ColumnType) -> T.DataType:
        if ctype.kind == "decimal":
            return T.DecimalType(ctype.precision, ctype.scale)
        return simple[ctype.kind]

    return T.StructType(
        [
            T.StructField("_file_idx", T.IntegerType()),
            T.StructField("_source_file", T.StringType()),
            T.StructField("_source_line", T.LongType()),
            *(T.StructField(name, spark_type(ctype)) for name, ctype in schema.columns),
            T.StructField("_reason", T.StringType()),
            T.StructField("_raw_text", T.StringType()),
        ]
    )


def read_typed(
    spark: Any,
    source: type,
    schema: Schema,
    root: str,
    files: list[str],
    *,
    required: Sequence[str] = (),
    raw_text: bool = False,
    **options: str,
) -> Any:
    """Read `files` with the typed data source `source` (one partition per file); `required`
    columns make a record without a value invalid, `raw_text` keeps every record's text.

    Registered on every read: a Spark Connect session can change under us.
    """
    spark.dataSource.register(source)
    reader = (
        spark.read.format(source.name())
        .schema(spark_struct(schema))
        .option("root", root)
        .option("files", json.dumps(files))
        .option("schema", schema.to_json())
        .option("required", json.dumps(list(required)))
        .option("raw_text", json.dumps(raw_text))
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def cap_reason(reason: str) -> str:
    """`reason`, cut to `MAX_REASON_CHARS`."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[: MAX_REASON_CHARS - 1] + "…"


def quarantine_text(text: str) -> str:
    """`text` made storable in PostgreSQL text: U+0000 becomes the four characters `\\x00`."""
    return text.replace("\x00", "\\x00")


def typed_columns_batch(
    schema: Schema,
    file_idx: int,
    source_file: str,
    lines: Sequence[int],
    columns: Sequence[pa.Array],
    reasons: Sequence[str | None],
    raw_texts: Sequence[str | None],
) -> pa.RecordBatch:
    """One batch of a typed source's frame from its parts (all of length `len(lines)`)."""
    n = len(lines)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([file_idx] * n, pa.int32()),
            pa.array([source_file] * n, pa.string()),
            pa.array(lines, pa.int64()),
            *columns,
            pa.array(reasons, pa.string()),
            pa.array(raw_texts, pa.string()),
        ],
        schema=arrow_schema(schema),
    )


class RowBuffer:
    """Collects records of one file as Python values and hands them out as Arrow batches.

    Args:
        schema: The declared columns.
        file_idx: The file's index in the window.
        source_file: The file's path relative to the landing root.
        batch_rows: How many records a batch holds at most.
    """

    def __init__(self, schema: Schema, file_idx: int, source_file: str, batch_rows: int) -> None:
        self.schema = schema
        self.file_idx = file_idx
        self.source_file = source_file
        self.batch_rows = batch_rows
        self._types = [ctype.arrow() for _, ctype in schema.columns]
        # Timestamps are collected as µs integers: Arrow takes them as they are, with no
        # time-zone guessing on the way.
        self._micros = [ctype.kind == "timestamp" for _, ctype in schema.columns]
        self._reset()

    def _reset(self) -> None:
        self._lines: list[int] = []
        self._values: list[list[Any]] = [[] for _ in self._types]
        self._reasons: list[str | None] = []
        self._raw: list[str | None] = []

    def __len__(self) -> int:
        return len(self._lines)

    def valid(self, line: int, values: Sequence[Any], raw_text: str | None = None) -> None:
        """Add a valid record: one value per declared column, in declared order (and its text,
        when the source keeps every record's)."""
        self._lines.append(line)
        for column, value in zip(self._values, values, strict=True):
            column.append(value)
        self._reasons.append(None)
        self._raw.append(None if raw_text is None else quarantine_text(raw_text))

    def invalid(self, line: int, reason: str, raw_text: str) -> None:
        """Add an invalid record: null values, the reason and the record's text."""
        self._lines.append(line)
        for column in self._values:
            column.append(None)
        self._reasons.append(cap_reason(reason))
        self._raw.append(quarantine_text(raw_text))

    def flush(self) -> pa.RecordBatch:
        """The records collected so far, as one batch; the buffer starts empty again."""
        columns = []
        for values, arrow_type, micros in zip(self._values, self._types, self._micros, strict=True):
            if micros:
                columns.append(pa.array(values, pa.int64()).cast(arrow_type))
            else:
                columns.append(pa.array(values, arrow_type))
        batch = typed_columns_batch(
            self.schema,
            self.file_idx,
            self.source_file,
            self._lines,
            columns,
            self._reasons,
            self._raw,
        )
        self._reset()
        return batch
