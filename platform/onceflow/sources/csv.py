"""CSV landing files with a declared schema: typed records, bad ones kept for the quarantine.

Each file is one Spark partition, read on an executor with Python's `csv` module (RFC 4180
quoting: `"` quotes, `""` inside quotes is a quote, quoted fields may hold delimiters and
newlines). Values follow the strict rules of `onceflow.sources._typed`.

How a file becomes records:

- Lines end at `\\n` (a `\\r` before it is part of the line ending). `_source_line` is the
  1-based physical line where a record starts, counting every line, blank ones and the header
  included.
- Lines that are empty or hold only whitespace, outside a quoted field, are not records.
- Text is UTF-8; a byte-order mark at the start of the file is dropped. Lines are decoded one by
  one, so bytes that are not UTF-8 make only the record they belong to invalid ("invalid UTF-8",
  its text kept with `\\xNN` escapes); the records around it are read as usual.
- Quoting is strict: a character after a closing quote other than the delimiter, or a quote
  still open at the end of the file, makes the record invalid ("malformed CSV: …"). Such a
  record that spans several lines has a quote opened on its first line that never closes
  properly: only that first line is the invalid record, and the lines after it are read
  again as records of their own. So a stray quote costs its own line, never the valid records
  after it.
- With `header=True` the first record names the columns: it must name every declared column
  once (spaces and tabs around names are trimmed; extra columns are ignored; order is free).
  Otherwise the header record and every record after it are invalid, with a reason naming the
  missing or repeated columns. With `header=False` fields come in declared order.
- A record with a different number of fields than the header (or the schema) is invalid
  ("expected N fields, got M").
- A `required` column left empty (or only spaces and tabs) makes its record invalid
  ("order_id: required, but empty").
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.errors import ConfigurationError
from onceflow.sources._typed import (
    REQUIRED_PROBLEM,
    Invalid,
    RowBuffer,
    Schema,
    check_folder,
    check_required,
    is_empty,
    normalise_schema,
    read_typed,
    spark_struct,
    text_converter,
)
from onceflow.sources.landing import FilePartition, LandingFiles
from onceflow.storage import Location, open_file

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Records per Arrow batch handed to Spark.
BATCH_ROWS = 8192

# Python's csv module refuses fields over 128 KiB by default and then resumes mid-record,
# which would turn the rest of a quoted field into bogus records. Input size is the landing
# producer's business, not a parse error.
_FIELD_SIZE_LIMIT = 2**31 - 1


@dataclass(frozen=True, init=False)
class CsvSource(LandingFiles):
    """CSV files under `<landing root>/<folder>`, typed by a declared schema.

    Args:
        folder: The folder under the landing root that producers write into.
        schema: Column name → type: `string`, `bigint`, `int`, `double`, `boolean`, `date`,
            `timestamp` (UTC) or `decimal(p,s)`. Names are plain identifiers not starting
            with `_`. Kept as an immutable mapping with canonical type names.
        suffix: The file-name ending of input files.
        delimiter: The one character between fields (`,`, `;`, `\\t`, `|`, …).
        header: The first record of each file names the columns (matched by name); without
            a header, fields come in the schema's order.
        required: Columns that must hold a value: a record whose field is empty (or only
            spaces and tabs) is invalid, quarantined with the reason, never a `""` key.
        raw_text: Keep every record's text in `_raw_text`, valid ones too (set by a job whose
            `parse` step may reject records of this source, so they keep their line).

    Raises:
        ConfigurationError: The schema or an option is not usable; the message says what to
            change.
    """

    folder: str
    suffix: str
    schema: Mapping[str, str]
    delimiter: str
    header: bool
    required: tuple[str, ...]
    raw_text: bool

    typed = True

    def __init__(
        self,
        folder: str,
        schema: Mapping[str, str],
        suffix: str = ".csv",
        delimiter: str = ",",
        header: bool = True,
        required: Sequence[str] = (),
        raw_text: bool = False,
    ) -> None:
        owner = f"CsvSource({folder!r})"
        check_folder(folder, suffix, owner)
        if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in '"\r\n\x00':
            raise ConfigurationError(
                f"{owner}: delimiter must be one character other than a quote, a newline or "
                f"NUL, such as ',' or '\\t'; got {delimiter!r}."
            )
        if not isinstance(header, bool):
            raise ConfigurationError(f"{owner}: header must be True or False, not {header!r}.")
        object.__setattr__(self, "folder", folder)
        object.__setattr__(self, "suffix", suffix)
        object.__setattr__(self, "schema", normalise_schema(schema, owner))
        object.__setattr__(self, "delimiter", delimiter)
        object.__setattr__(self, "header", header)
        object.__setattr__(self, "required", check_required(required, self.schema, owner))
        object.__setattr__(self, "raw_text", bool(raw_text))

    def describe(self) -> str:
        return f"CSV landing files `{self.folder}/*{self.suffix}` ({len(self.schema)} columns)"

    def read_files(self, spark: SparkSession, root: Location, files: list[str]) -> DataFrame:
        assert isinstance(self.schema, Schema)
        return read_typed(
            spark, _CsvDataSource, self.schema, root.uri, files,
            required=self.required, raw_text=self.raw_text,
            delimiter=self.delimiter, header=json.dumps(self.header),
        )  # fmt: skip


class _LineFeed:
    """Feeds a binary file to `csv.reader` one decoded line at a time, remembering which
    physical lines the record being parsed has used, so each record knows where it starts, its
    exact text, and whether any of its lines was not UTF-8. Lines given back (`confine`) are
    fed again before the rest of the file."""

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.number = 0
        # The current record's lines: (number, text, not UTF-8).
        self.pending: list[tuple[int, str, bool]] = []
        self._again: list[tuple[int, str, bool]] = []  # to feed again, last first

    def __iter__(self) -> _LineFeed:
        return self

    def __next__(self) -> str:
        if self._again:
            line = self._again.pop()
        else:
            raw = next(self._handle)
            self.number += 1
            bad = False
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="backslashreplace")
                bad = True
            if self.number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            line = (self.number, text, bad)
        self.pending.append(line)
        return line[1]

    @property
    def lines_taken(self) -> int:
        return len(self.pending)

    def take(self) -> tuple[int, str, bool]:
        """The finished record's first line, text (without its final line ending) and
        whether it held bytes that are not UTF-8; the feed starts a new record."""
        first = self.pending[0][0] if self.pending else self.number
        text = _without_line_end("".join(text for _, text, _ in self.pending))
        bad = any(bad for _, _, bad in self.pending)
        self.pending = []
        return first, text, bad

    def confine(self) -> tuple[int, str, bool]:
        """Take only the record's first line as the record; its other lines are fed again."""
        rest = self.pending[1:]
        self.pending = self.pending[:1]
        self._again.extend(reversed(rest))
        return self.take()


def _without_line_end(text: str) -> str:
    if text.endswith("\n"):
        return text[:-2] if text.endswith("\r\n") else text[:-1]
    return text


def _header_layout(schema: Schema, names: list[str]) -> tuple[list[int], str | None]:
    """Field index of each declared column in a header, or the reason the header is unusable."""
    trimmed = [name.strip(" \t") for name in names]
    missing, repeated, layout = [], [], []
    for column, _ in schema.columns:
        count = trimmed.count(column)
        if count == 0:
            missing.append(column)
        elif count > 1:
            repeated.append(column)
        else:
            layout.append(trimmed.index(column))
    if missing:
        plural = "s" if len(missing) > 1 else ""
        return [], f"header lacks column{plural} {', '.join(missing)}"
    if repeated:
        return [], f"header names {', '.join(repeated)} more than once"
    return layout, None


def iter_csv_file(
    path: Path | Location,
    file_idx: int,
    source_file: str,
    schema: Schema,
    delimiter: str,
    header: bool,
    batch_rows: int = BATCH_ROWS,
    required: Sequence[str] = (),
    raw_text: bool = False,
) -> Iterator[pa.RecordBatch]:
    """The records of one CSV file as batches of the typed frame.

    Args:
        path: The file.
        file_idx: Its index in the window.
        source_file: Its path relative to the landing root.
        schema: The declared columns.
        delimiter: The field delimiter.
        header: Whether the first record names the columns.
        batch_rows: Records per batch at most.
        required: Columns that must hold a value.
        raw_text: Keep every record's text, valid ones too.
    """
    csv.field_size_limit(_FIELD_SIZE_LIMIT)
    names = [name for name, _ in schema.columns]
    needed = [name in required for name in names]
    converters = [text_converter(ctype) for _, ctype in schema.columns]
    buffer = RowBuffer(schema, file_idx, source_file, batch_rows)
    layout: list[int] | None = None if header else list(range(len(names)))
    expected_fields = len(names)
    header_problem: str | None = None
    with open_file(path) as handle:
        feed = _LineFeed(handle)
        reader = csv.reader(feed, delimiter=delimiter, quotechar='"', doublequote=True, strict=True)
        while True:
            error: str | None = None
            fields: list[str] = []
            try:
                fields = next(reader)
            except StopIteration:
                if feed.lines_taken <= 1:
                    break
                # The file ended inside a quoted field opened on the record's first line.
                error = "malformed CSV: unexpected end of data"
            except csv.Error as exc:
                error = f"malformed CSV: {exc}"
            if error is not None and feed.lines_taken > 1:
                # A quote opened on the record's first line never closed properly: that line
                # is the invalid record, and the lines after it are records of their own.
                line, text, bad_utf8 = feed.confine()
                error = f"{error} (unterminated quote on this line; the lines after it are read on their own)"
                reader = csv.reader(
                    feed, delimiter=delimiter, quotechar='"', doublequote=True, strict=True
                )
            else:
                line, text, bad_utf8 = feed.take()
            if not text.strip():
                continue
            if layout is None and header_problem is None:
                # The header record: it decides the layout of every record after it.
                if bad_utf8:
                    header_problem = "header: invalid UTF-8"
                elif error:
                    header_problem = f"header: {error}"
                else:
                    layout, header_problem = _header_layout(schema, fields)
                    expected_fields = len(fields)
                if header_problem is None:
                    continue
            reason = (
                header_problem
                or ("invalid UTF-8" if bad_utf8 else None)
                or error
                or (
                    f"expected {expected_fields} fields, got {len(fields)}"
                    if len(fields) != expected_fields
                    else None
                )
            )
            if reason is None:
                assert layout is not None
                values, problems = [], []
                for name, convert, index, must in zip(
                    names, converters, layout, needed, strict=True
                ):
                    try:
                        value = convert(fields[index])
                    except Invalid as exc:
                        problems.append(f"{name}: {exc}")
                        continue
                    if must and is_empty(value):
                        problems.append(f"{name}: {REQUIRED_PROBLEM}")
                    values.append(value)
                if problems:
                    reason = "; ".join(problems)
                else:
                    buffer.valid(line, values, text if raw_text else None)
            if reason is not None:
                buffer.invalid(line, reason, text)
            if len(buffer) >= batch_rows:
                yield buffer.flush()
        if feed.pending:
            # csv.reader ended inside a one-line record without saying so: keep its text.
            line, text, _ = feed.take()
            if text.strip():
                buffer.invalid(line, "malformed CSV: incomplete record at end of file", text)
    if len(buffer):
        yield buffer.flush()


class _CsvReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.root = options["root"]
        self.files: list[str] = json.loads(options["files"])
        self.schema = Schema.from_json(options["schema"])
        self.delimiter = options["delimiter"]
        self.header: bool = json.loads(options["header"])
        self.required: list[str] = json.loads(options.get("required", "[]"))
        self.raw_text: bool = json.loads(options.get("raw_text", "false"))

    def partitions(self) -> list[InputPartition]:
        return [FilePartition(i, path) for i, path in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not self.files:
            # An empty window: Spark still runs one task, with its default partition.
            return iter(())
        assert isinstance(partition, FilePartition)
        return iter_csv_file(
            Location.parse(self.root) / partition.path,
            partition.index,
            partition.path,
            self.schema,
            self.delimiter,
            self.header,
            required=self.required,
            raw_text=self.raw_text,
        )


class _CsvDataSource(DataSource):
    """Spark data source `onceflow_csv`: one partition per file, typed rows as Arrow batches."""

    @classmethod
    def name(cls) -> str:
        return "onceflow_csv"

    def schema(self) -> Any:
        return spark_struct(Schema.from_json(self.options["schema"]))

    def reader(self, schema: Any) -> DataSourceReader:
        return _CsvReader(dict(self.options))
