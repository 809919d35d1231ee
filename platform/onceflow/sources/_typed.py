"""What typed landing sources (CSV, Parquet) share: the declared schema and the value rules.

A typed source's frame is

    _file_idx INT, _source_file STRING, _source_line BIGINT, <declared columns>, _reason STRING,
    _raw_text STRING

with every declared column null on an invalid record, `_reason` naming the column and the
problem, and `_raw_text` holding the record as text for the quarantine.

The value rules for text (a CSV field, or a Parquet string column declared with another type)
are strict, because a value that is silently rounded or guessed lands in a ledger for good:

- surrounding spaces and tabs are trimmed for every type except `string`; a field that is then
  empty is null (a `string` field is kept exactly, and an empty one stays "");
- `int` / `bigint`: an optional sign and ASCII digits, in range (no "1.0", "1e3", "1_000");
- `double`: a decimal literal with an optional exponent; "nan", "inf" and values that overflow
  are invalid;
- `boolean`: "true" or "false", any case;
- `date`: `YYYY-MM-DD`;
- `timestamp`: RFC 3339 with a `Z` or `±HH:MM` offset (`T`, `t` or a space between date and
  time), converted to UTC; naive timestamps, leap seconds and digits past microseconds (other
  than zeros) are invalid;
- `decimal(p,s)`: a decimal literal (exponent allowed) that fits exactly: more than `s` digits
  after the point (trailing zeros aside) or more than `p - s` before it is invalid, never
  rounded;
- every value: dates and timestamps must fall in the years 1–9999, and strings must not hold
  U+0000 (PostgreSQL text cannot store it, so a sink would refuse the row forever);
- a column the source declares `required` must hold a value: null, empty or only spaces and
  tabs makes the record invalid (`<column>: required, but empty`), never a `""` key.

With `raw_text` (a job that has a `parse` step on the typed source), `_raw_text` holds every
record's text, valid ones too, so a record the parse rejects keeps it in the quarantine.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Context, Decimal, InvalidOperation
from typing import Any

import pyarrow as pa

from onceflow._identifiers import check_identifier
from onceflow.errors import ConfigurationError

#: The longest `_reason` a typed source writes; longer reasons are cut with "…".
MAX_REASON_CHARS = 200

_SIMPLE_TYPES = ("string", "bigint", "int", "double", "boolean", "date", "timestamp")
_DECIMAL_TYPE = re.compile(r"decimal\(\s*([0-9]+)\s*,\s*([0-9]+)\s*\)\Z", re.ASCII)
_MAX_DECIMAL_PRECISION = 38


@dataclass(frozen=True)
class ColumnType:
    """One declared column type.

    Attributes:
        kind: `string`, `bigint`, `int`, `double`, `boolean`, `date`, `timestamp` or `decimal`.
        precision: Total digits of a decimal (0 otherwise).
        scale: Digits after the point of a decimal (0 otherwise).
    """

    kind: str
    precision: int = 0
    scale: int = 0

    @property
    def sql(self) -> str:
        """The Spark SQL spelling (`decimal(12,2)`, `bigint`)."""
        if self.kind == "decimal":
            return f"decimal({self.precision},{self.scale})"
        return self.kind

    def arrow(self) -> pa.DataType:
        """The Arrow type Spark expects for this column in a data source's batches."""
        if self.kind == "decimal":
            return pa.decimal128(self.precision, self.scale)
        return _ARROW_TYPES[self.kind]()


_ARROW_TYPES: dict[str, Callable[[], pa.DataType]] = {
    "string": pa.string,
    "bigint": pa.int64,
    "int": pa.int32,
    "double": pa.float64,
    "boolean": pa.bool_,
    "date": pa.date32,
    "timestamp": lambda: pa.timestamp("us", tz="UTC"),
}


def parse_type(text: str, column: str) -> ColumnType:
    """Read a declared type (case and spaces inside `decimal(…)` do not matter).

    Args:
        text: The type as written in the schema.
        column: The column it belongs to, for the error message.

    Raises:
        ConfigurationError: The type is not one typed sources support.
    """
    allowed = ", ".join((*_SIMPLE_TYPES, "decimal(p,s)"))
    if not isinstance(text, str):
        raise ConfigurationError(
            f"column {column!r}: type must be a string such as 'bigint', not "
            f"{type(text).__name__}; use one of {allowed}."
        )
    norm = text.strip().lower()
    if norm in _SIMPLE_TYPES:
        return ColumnType(norm)
    match = _DECIMAL_TYPE.match(norm)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        if not 1 <= precision <= _MAX_DECIMAL_PRECISION or scale > precision:
            raise ConfigurationError(
                f"column {column!r}: {text!r} is out of bounds; use decimal(p,s) with "
                f"1 ≤ p ≤ {_MAX_DECIMAL_PRECISION} and 0 ≤ s ≤ p."
            )
        return ColumnType("decimal", precision, scale)
    raise ConfigurationError(f"column {column!r}: unknown type {text!r}; use one of {allowed}.")


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


class Invalid(ValueError):
    """A value breaks its column's rule; the message says how (never quoting the value)."""


TextConverter = Callable[[str], Any]

_INT = re.compile(r"[+-]?[0-9]+\Z", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z", re.ASCII)
_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})\Z", re.ASCII)
_TIMESTAMP = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))?\Z",
    re.ASCII,
)
_TRIM = " \t"
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_DAY_US = 86_400_000_000
#: Timestamps (µs since the epoch, UTC) that stay inside the years 1–9999.
MIN_TIMESTAMP_US = (date(1, 1, 1).toordinal() - _EPOCH_ORDINAL) * _DAY_US
MAX_TIMESTAMP_US = (date(9999, 12, 31).toordinal() - _EPOCH_ORDINAL + 1) * _DAY_US - 1
_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "bigint": (-(2**63), 2**63 - 1)}


def _string(text: str) -> str:
    if "\x00" in text:
        raise Invalid("contains U+0000, which PostgreSQL text cannot store")
    return text


def _integer(kind: str) -> TextConverter:
    low, high = _INT_RANGES[kind]

    def convert(text: str) -> int | None:
        text = text.strip(_TRIM)
        if not text:
            return None
        if not _INT.match(text):
            raise Invalid("not an integer")
        # int() refuses very long digit strings (and they are out of range anyway).
        if len(text.lstrip("+-").lstrip("0")) > 20:
            raise Invalid(f"out of range for {kind}")
        value = int(text)
        if not low <= value <= high:
            raise Invalid(f"out of range for {kind}")
        return value

    return convert


def _double(text: str) -> float | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    if not _FLOAT.match(text):
        raise Invalid("not a number (nan and inf are not accepted)")
    value = float(text)
    if math.isinf(value):
        raise Invalid("out of range for double")
    return value


def _boolean(text: str) -> bool | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    folded = text.lower()
    if folded == "true":
        return True
    if folded == "false":
        return False
    raise Invalid("not a boolean (true or false)")


def _date(text: str) -> date | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    match = _DATE.match(text)
    if not match:
        raise Invalid("not a date (YYYY-MM-DD)")
    try:
        return date(int(match.group(1)), int(match.group(2)), int(match.group(3)))
    except ValueError:
        raise Invalid("not a valid calendar date") from None


def _timestamp(text: str) -> int | None:
    """Micro-seconds since the epoch, UTC."""
    text = text.strip(_TRIM)
    if not text:
        return None
    match = _TIMESTAMP.match(text)
    if not match:
        raise Invalid("not an RFC 3339 timestamp (YYYY-MM-DDTHH:MM:SS[.ffffff]Z or ±HH:MM)")
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if zulu is None and sign is None:
        raise Invalid("timestamp has no UTC offset (add Z or ±HH:MM)")
    try:
        days = date(int(year), int(month), int(day)).toordinal() - _EPOCH_ORDINAL
    except ValueError:
        raise Invalid("not a valid calendar date") from None
    if int(hour) > 23 or int(minute) > 59 or int(second) > 59:
        raise Invalid("not a valid time of day")
    micros = 0
    if fraction:
        if len(fraction) > 6 and fraction[6:].strip("0"):
            raise Invalid("more precise than microseconds")
        micros = int(fraction[:6].ljust(6, "0"))
    offset_s = 0
    if sign is not None:
        if int(off_h) > 23 or int(off_m) > 59:
            raise Invalid("not a valid UTC offset")
        offset_s = (int(off_h) * 3600 + int(off_m) * 60) * (1 if sign == "+" else -1)
    seconds = days * 86400 + int(hour) * 3600 + int(minute) * 60 + int(second) - offset_s
    value = seconds * 1_000_000 + micros
    if not MIN_TIMESTAMP_US <= value <= MAX_TIMESTAMP_US:
        raise Invalid("outside the years 1-9999 in UTC")
    return value


def _decimal(precision: int, scale: int) -> TextConverter:
    quantum = Decimal(1).scaleb(-scale)
    context = Context(prec=precision)
    integer_digits = precision - scale

    def convert(text: str) -> Decimal | None:
        text = text.strip(_TRIM)
        if not text:
            return None
        if not _FLOAT.match(text):
            raise Invalid("not a decimal number")
        try:
            value = Decimal(text)
        except (InvalidOperation, ValueError):
            raise Invalid("not a decimal number") from None
        if value.is_zero():
            return Decimal(0).quantize(quantum, context=context)
        _, digits, exponent = value.as_tuple()
        assert isinstance(exponent, int)
        count = len(digits)
        # Zeros at the end of the fraction carry no value: "1.50" fits decimal(p,1).
        while exponent < 0 and digits[count - 1] == 0:
            count -= 1
            exponent += 1
        if -exponent > scale:
            raise Invalid(
                f"more than {scale} digits after the point for decimal({precision},{scale})"
            )
        if count + exponent > integer_digits:
            raise Invalid(f"too large for decimal({precision},{scale})")
        return value.quantize(quantum, context=context)

    return convert


def text_converter(ctype: ColumnType) -> TextConverter:
    """The function that turns a text field into a `ctype` value, or raises `Invalid`.

    Timestamps come back as micro-seconds since the epoch (UTC), the rest as Python values
    Arrow takes for `ctype.arrow()`.
    """
    if ctype.kind == "string":
        return _string
    if ctype.kind in _INT_RANGES:
        return _integer(ctype.kind)
    if ctype.kind == "decimal":
        return _decimal(ctype.precision, ctype.scale)
    return {"double": _double, "boolean": _boolean, "date": _date, "timestamp": _timestamp}[
        ctype.kind
    ]


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
