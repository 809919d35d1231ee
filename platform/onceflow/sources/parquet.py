"""Parquet landing files with a declared schema: typed records, bad ones kept for the quarantine.

Each file is one Spark partition, read with pyarrow on an executor (page checksums verified
where the writer stored them). `_source_line` is the record's 1-based row number in the file.

How file columns become declared columns (matched by exact name; extra columns are ignored):

- A value is converted only when nothing is lost: integers in range, floats with an integral
  value into integer columns, integers within ±2^53 into `double`, decimals that fit the
  declared precision and scale, timestamps without digits past microseconds. A value that does not fit makes its row invalid; the rest of
  the file is read as usual.
- Naive Parquet timestamps are taken as UTC; zoned ones are converted to UTC. Dates and
  timestamps must fall in the years 1–9999. `double` columns refuse NaN and ±infinity, `string`
  columns refuse U+0000 (the same rules as CSV, so a job's valid rows do not depend on the
  file format).
- A string column declared with another type is parsed with the CSV text rules; a binary column
  declared `string` must hold UTF-8. Decimals into `double` must read back as the same number.
- A declared column that is missing, present twice, or of a kind that cannot hold the declared
  type (a boolean declared `date`, a number declared `string`) makes every row of the file
  invalid, with a reason naming the columns.

A `required` column holding null (or, declared `string`, an empty text or only spaces and tabs)
makes its row invalid ("order_id: required, but empty").

`_raw_text` of an invalid row (of every row, with `raw_text`) is the row as compact JSON (values
through `str` where JSON has no type): the declared columns when a value failed, every column of
the file when the file's columns do not match the schema.

A file pyarrow cannot read gives one invalid row at `_source_line` 0 with the reason "not a
readable Parquet file: <error class>" and an empty `_raw_text`, after any rows read before the
damage was found (the reason then says from which row). A file that has gone missing is not
"unreadable": the task fails, and the window is read again later.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.sources._typed import (
    MAX_TIMESTAMP_US,
    MIN_TIMESTAMP_US,
    REQUIRED_PROBLEM,
    ColumnType,
    Invalid,
    Schema,
    cap_reason,
    check_folder,
    check_required,
    normalise_schema,
    quarantine_text,
    read_typed,
    spark_struct,
    text_converter,
    typed_columns_batch,
)
from onceflow.sources.landing import FilePartition, LandingFiles
from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Rows per Arrow batch read from a file and handed to Spark.
BATCH_ROWS = 65536


@dataclass(frozen=True, init=False)
class ParquetSource(LandingFiles):
    """Parquet files under `<landing root>/<folder>`, typed by a declared schema.

    Args:
        folder: The folder under the landing root that producers write into.
        schema: Column name → type: `string`, `bigint`, `int`, `double`, `boolean`, `date`,
            `timestamp` (UTC) or `decimal(p,s)`. Names are plain identifiers not starting
            with `_`, matched against the file's top-level column names exactly.
        suffix: The file-name ending of input files.
        required: Columns that must hold a value: a row with null there (or an empty text in
            a `string` column) is invalid, quarantined with the reason.
        raw_text: Keep every row as JSON in `_raw_text`, valid ones too (set by a job whose
            `parse` step may reject rows of this source).

    Raises:
        ConfigurationError: The schema or an option is not usable; the message says what to
            change.
    """

    folder: str
    suffix: str
    schema: Mapping[str, str]
    required: tuple[str, ...]
    raw_text: bool

    typed = True

    def __init__(
        self,
        folder: str,
        schema: Mapping[str, str],
        suffix: str = ".parquet",
        required: Sequence[str] = (),
        raw_text: bool = False,
    ) -> None:
        owner = f"ParquetSource({folder!r})"
        check_folder(folder, suffix, owner)
        object.__setattr__(self, "folder", folder)
        object.__setattr__(self, "suffix", suffix)
        object.__setattr__(self, "schema", normalise_schema(schema, owner))
        object.__setattr__(self, "required", check_required(required, self.schema, owner))
        object.__setattr__(self, "raw_text", bool(raw_text))

    def describe(self) -> str:
        return f"Parquet landing files `{self.folder}/*{self.suffix}` ({len(self.schema)} columns)"

    def read_files(self, spark: SparkSession, root: Location, files: list[str]) -> DataFrame:
        assert isinstance(self.schema, Schema)
        return read_typed(
            spark, _ParquetDataSource, self.schema, root.uri, files,
            required=self.required, raw_text=self.raw_text,
        )  # fmt: skip


def _family(arrow_type: pa.DataType) -> str:
    t = pa.types
    if t.is_dictionary(arrow_type):
        return _family(arrow_type.value_type)
    if t.is_null(arrow_type):
        return "null"
    if t.is_boolean(arrow_type):
        return "boolean"
    if t.is_integer(arrow_type):
        return "integer"
    if t.is_floating(arrow_type):
        return "float"
    if t.is_decimal(arrow_type):
        return "decimal"
    if t.is_string(arrow_type) or t.is_large_string(arrow_type) or t.is_string_view(arrow_type):
        return "string"
    if (
        t.is_binary(arrow_type)
        or t.is_large_binary(arrow_type)
        or t.is_fixed_size_binary(arrow_type)
        or t.is_binary_view(arrow_type)
    ):
        return "binary"
    if t.is_date(arrow_type):
        return "date"
    if t.is_timestamp(arrow_type):
        return "timestamp"
    return "other"


# Which kinds of file column each declared type reads. Everything also reads an all-null
# column; strings are parsed by the CSV text rules.
_READS: dict[str, frozenset[str]] = {
    "string": frozenset({"string", "binary"}),
    "bigint": frozenset({"integer", "float", "decimal", "string"}),
    "int": frozenset({"integer", "float", "decimal", "string"}),
    "double": frozenset({"integer", "float", "decimal", "string"}),
    "decimal": frozenset({"integer", "decimal", "string"}),
    "boolean": frozenset({"boolean", "string"}),
    "date": frozenset({"date", "string"}),
    "timestamp": frozenset({"timestamp", "date", "string"}),
}


def _file_problems(file_schema: pa.Schema, schema: Schema) -> str | None:
    """Why the file's columns cannot give the declared ones (None when they can)."""
    missing, repeated, mismatched = [], [], []
    for name, ctype in schema.columns:
        indices = file_schema.get_all_field_indices(name)
        if not indices:
            missing.append(name)
        elif len(indices) > 1:
            repeated.append(name)
        else:
            family = _family(file_schema.field(indices[0]).type)
            if family != "null" and family not in _READS[ctype.kind]:
                mismatched.append(
                    f"column {name} is {file_schema.field(indices[0]).type}, "
                    f"which cannot be read as {ctype.sql}"
                )
    problems = []
    if missing:
        plural = "s" if len(missing) > 1 else ""
        problems.append(f"missing column{plural} {', '.join(missing)}")
    if repeated:
        problems.append(f"column {', '.join(repeated)} appears more than once in the file")
    problems.extend(mismatched)
    return "; ".join(problems) or None


def _python_convert(
    values: list[Any], ctype: ColumnType, convert: Any
) -> tuple[pa.Array, dict[int, str]]:
    """Convert value by value with `convert` (which raises `Invalid`)."""
    out: list[Any] = []
    problems: dict[int, str] = {}
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        try:
            out.append(convert(value))
        except Invalid as exc:
            problems[i] = str(exc)
            out.append(None)
    if ctype.kind == "timestamp":
        return pa.array(out, pa.int64()).cast(ctype.arrow()), problems
    return pa.array(out, ctype.arrow()), problems


def _decode_utf8(value: bytes) -> str:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid("invalid UTF-8") from None
    return text_converter(ColumnType("string"))(text)


def _decimal_to_double(value: Decimal) -> float:
    result = float(value)
    # "Lossless" for a double means it prints back as the same number.
    if Decimal(repr(result)) != value:
        raise Invalid("does not fit double without loss")
    return result


def _safe_cast(
    arr: pa.Array, target: pa.DataType, ctype: ColumnType
) -> tuple[pa.Array, dict[int, str]]:
    """Arrow's safe cast; when some values do not fit, find them one by one (rare path)."""
    try:
        return arr.cast(target, safe=True), {}
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    problems: dict[int, str] = {}
    for i in range(len(arr)):
        try:
            arr.slice(i, 1).cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            # Arrow's message quotes the value; reasons never do.
            problems[i] = f"does not fit {ctype.sql} without loss or overflow"
    keep = pa.array([i not in problems for i in range(len(arr))], pa.bool_())
    cleaned = pc.if_else(keep, arr, pa.scalar(None, arr.type))
    return cleaned.cast(target, safe=True), problems


def _convert(arr: pa.Array, ctype: ColumnType) -> tuple[pa.Array, dict[int, str]]:
    """A file column as the declared type, and the problem of each row that does not fit."""
    target = ctype.arrow()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    family = _family(arr.type)
    if family == "null":
        return pa.nulls(len(arr), target), {}
    if family == "string" and ctype.kind != "string":
        return _python_convert(arr.to_pylist(), ctype, text_converter(ctype))
    if family == "binary":
        return _python_convert(arr.to_pylist(), ctype, _decode_utf8)
    if family == "decimal" and ctype.kind == "double":
        return _python_convert(arr.to_pylist(), ctype, _decimal_to_double)
    if family == "integer" and ctype.kind == "decimal":
        # Arrow sizes an integer → decimal cast by the type, not the values (int64 needs 19
        # digits); go through decimal(38, s) so each value is checked against the precision.
        if ctype.scale > 18:
            convert = text_converter(ctype)
            return _python_convert(arr.to_pylist(), ctype, lambda v: convert(str(v)))
        arr = arr.cast(pa.decimal128(38, ctype.scale))
    result, problems = _safe_cast(arr, target, ctype)
    if ctype.kind == "string":
        _flag(problems, pc.match_substring(result, "\x00"), _NUL)
    elif ctype.kind == "double":
        _flag(problems, pc.invert(pc.is_finite(result)), "NaN or infinity is not accepted")
    elif ctype.kind in ("date", "timestamp"):
        numbers = result.cast(pa.int32() if ctype.kind == "date" else pa.int64())
        low, high = (
            (_MIN_DAY, _MAX_DAY) if ctype.kind == "date" else (MIN_TIMESTAMP_US, MAX_TIMESTAMP_US)
        )
        outside = pc.or_(pc.less(numbers, low), pc.greater(numbers, high))
        _flag(problems, outside, "outside the years 1-9999")
    return result, problems


_NUL = "contains U+0000, which PostgreSQL text cannot store"


def _flag(problems: dict[int, str], mask: pa.Array, problem: str) -> None:
    """Record `problem` for every row where `mask` is true (null counts as false)."""
    for i in pc.indices_nonzero(mask.fill_null(False)).to_pylist():
        problems[i] = problem


_MIN_DAY = MIN_TIMESTAMP_US // 86_400_000_000
_MAX_DAY = MAX_TIMESTAMP_US // 86_400_000_000


def _pylist(column: pa.Array) -> list[Any]:
    """The column's values as Python objects, for `_raw_text`.

    Values Python cannot hold (a date past 9999, a timestamp past year 9999) come back as
    Arrow prints them, so a row that is invalid for that reason can still be quarantined.
    """
    try:
        return column.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException):
        pass
    try:
        return column.cast(pa.string()).to_pylist()
    except (pa.ArrowException, OverflowError, ValueError):
        pass
    values: list[Any] = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except (OverflowError, ValueError, pa.ArrowException):
            # Arrow prints a one-value array as "[value]".
            printed = column.slice(i, 1).to_string(window=1, skip_new_lines=True).strip()
            values.append(printed[1:-1] if printed.startswith("[") else printed)
    return values


def _rows_json(batch: pa.RecordBatch, names: list[str] | None = None) -> list[str]:
    """Each row of `batch` (its columns `names`, default all) as compact JSON."""
    names = batch.schema.names if names is None else names
    columns = [_pylist(batch.column(i)) for i in range(batch.num_columns)]
    by_name = dict(zip(batch.schema.names, columns, strict=True))
    rows = zip(*(by_name[name] for name in names), strict=True)
    return [
        quarantine_text(
            json.dumps(
                dict(zip(names, row, strict=True)),
                separators=(",", ":"),
                default=str,
                ensure_ascii=False,
            )
        )
        for row in rows
    ]


def _typed_batch(
    batch: pa.RecordBatch,
    first_row: int,
    schema: Schema,
    file_idx: int,
    source_file: str,
    required: Sequence[str] = (),
    raw_text: bool = False,
) -> pa.RecordBatch:
    n = batch.num_rows
    columns: list[pa.Array] = []
    problems: dict[int, list[str]] = {}
    for name, ctype in schema.columns:
        values, bad = _convert(batch.column(name), ctype)
        columns.append(values)
        if name in required:
            empty = pc.is_null(values)
            if ctype.kind == "string":
                empty = pc.or_(empty, pc.equal(pc.utf8_trim(values, " \t"), ""))
            for i in pc.indices_nonzero(empty.fill_null(True)).to_pylist():
                bad.setdefault(i, REQUIRED_PROBLEM)
        for i, problem in bad.items():
            problems.setdefault(i, []).append(f"{name}: {problem}")
    reasons: list[str | None] = [None] * n
    raw: list[str | None] = [None] * n
    names = [name for name, _ in schema.columns]
    if raw_text:
        raw = list(_rows_json(batch, names))
    if problems:
        rows = sorted(problems)
        texts = _rows_json(batch.take(pa.array(rows, pa.int64())), names)
        for i, text in zip(rows, texts, strict=True):
            reasons[i] = cap_reason("; ".join(problems[i]))
            raw[i] = text
        keep = pa.array([r is None for r in reasons], pa.bool_())
        columns = [pc.if_else(keep, c, pa.scalar(None, c.type)) for c in columns]
    lines = list(range(first_row + 1, first_row + n + 1))
    return typed_columns_batch(schema, file_idx, source_file, lines, columns, reasons, raw)


def _invalid_batch(
    batch: pa.RecordBatch,
    first_row: int,
    schema: Schema,
    file_idx: int,
    source_file: str,
    reason: str,
) -> pa.RecordBatch:
    n = batch.num_rows
    columns = [pa.nulls(n, ctype.arrow()) for _, ctype in schema.columns]
    lines = list(range(first_row + 1, first_row + n + 1))
    raw = _rows_json(batch)
    return typed_columns_batch(
        schema, file_idx, source_file, lines, columns, [cap_reason(reason)] * n, raw
    )


def iter_parquet_file(
    path: Path | Location,
    file_idx: int,
    source_file: str,
    schema: Schema,
    batch_rows: int = BATCH_ROWS,
    required: Sequence[str] = (),
    raw_text: bool = False,
) -> Iterator[pa.RecordBatch]:
    """The rows of one Parquet file as batches of the typed frame.

    Args:
        path: The file.
        file_idx: Its index in the window.
        source_file: Its path relative to the landing root.
        schema: The declared columns.
        batch_rows: Rows per batch at most.
        required: Columns that must hold a value.
        raw_text: Keep every row's JSON, valid ones too.

    Raises:
        OSError: The file cannot be opened (gone, not permitted): the task fails rather than
            reporting input it never saw.
    """
    if isinstance(path, Location) and not path.is_local:
        handle = pa.BufferReader(path.read_bytes())
    else:
        handle = pa.OSFile(str(path))
    try:
        # Only pyarrow's own reading counts as damage; a failure in the conversions below is a
        # bug and must fail the task, not be reported as a bad file.
        rows_done = 0
        try:
            parquet = pq.ParquetFile(
                handle, page_checksum_verification=True, coerce_int96_timestamp_unit="us"
            )
            problem = _file_problems(parquet.schema_arrow, schema)
            names = None if problem else [name for name, _ in schema.columns]
            batches = parquet.iter_batches(batch_size=batch_rows, columns=names)
        except (pa.ArrowException, OSError) as exc:
            yield _unreadable(schema, file_idx, source_file, rows_done, exc)
            return
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as exc:
                # pyarrow reports damage as ArrowInvalid, or OSError for a failed checksum.
                yield _unreadable(schema, file_idx, source_file, rows_done, exc)
                return
            if problem:
                yield _invalid_batch(batch, rows_done, schema, file_idx, source_file, problem)
            else:
                yield _typed_batch(
                    batch, rows_done, schema, file_idx, source_file, required, raw_text
                )
            rows_done += batch.num_rows
    finally:
        handle.close()


def _unreadable(
    schema: Schema, file_idx: int, source_file: str, rows_done: int, exc: BaseException
) -> pa.RecordBatch:
    where = f" after row {rows_done}" if rows_done else ""
    return typed_columns_batch(
        schema,
        file_idx,
        source_file,
        [0],
        [pa.nulls(1, ctype.arrow()) for _, ctype in schema.columns],
        [f"not a readable Parquet file{where}: {type(exc).__name__}"],
        [""],
    )


class _ParquetReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.root = options["root"]
        self.files: list[str] = json.loads(options["files"])
        self.schema = Schema.from_json(options["schema"])
        self.required: list[str] = json.loads(options.get("required", "[]"))
        self.raw_text: bool = json.loads(options.get("raw_text", "false"))

    def partitions(self) -> list[InputPartition]:
        return [FilePartition(i, path) for i, path in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not self.files:
            # An empty window: Spark still runs one task, with its default partition.
            return iter(())
        assert isinstance(partition, FilePartition)
        return iter_parquet_file(
            Location.parse(self.root) / partition.path,
            partition.index,
            partition.path,
            self.schema,
            required=self.required,
            raw_text=self.raw_text,
        )


class _ParquetDataSource(DataSource):
    """Spark data source `onceflow_parquet`: one partition per file, typed rows as Arrow
    batches."""

    @classmethod
    def name(cls) -> str:
        return "onceflow_parquet"

    def schema(self) -> Any:
        return spark_struct(Schema.from_json(self.options["schema"]))

    def reader(self, schema: Any) -> DataSourceReader:
        return _ParquetReader(dict(self.options))
