"""A typed source's window read with its plain iterators (`iter_csv_file`, `iter_parquet_file`),
no Spark: what one Spark task per file yields, in file then record order, with the driver's
check of the planned files first. Rows come out as Spark's `collect()` gives them in the tests
(timestamps as Spark's UTC strings), so a rule's truth table and the one Spark test per source
compare the same values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import pyarrow as pa

from onceflow.errors import SourceError
from onceflow.settings import Settings
from onceflow.sources.csv import CsvSource, iter_csv_file
from onceflow.sources.parquet import ParquetSource, iter_parquet_file


def _batches(
    settings: Settings, source: CsvSource | ParquetSource, offsets: Mapping[str, Any]
) -> Iterator[pa.RecordBatch]:
    problems = source.check_available(settings, offsets)
    if problems:  # the driver's check before a read (LandingFiles.read)
        raise SourceError("window input is no longer what was planned: " + "; ".join(problems))
    for index, rel in enumerate(source.units(offsets)):
        path = settings.landing / rel
        if isinstance(source, CsvSource):
            yield from iter_csv_file(
                path, index, rel, source.schema, source.delimiter, source.header,
                required=source.required, raw_text=source.raw_text,
            )  # fmt: skip
        else:
            yield from iter_parquet_file(
                path, index, rel, source.schema,
                required=source.required, raw_text=source.raw_text,
            )  # fmt: skip


def spark_text(value: datetime) -> str:
    """A UTC timestamp as Spark's `CAST(… AS STRING)` writes it (trailing zeros of the
    fraction dropped)."""
    text = (
        f"{value.year:04d}-{value.month:02d}-{value.day:02d} "
        f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    )
    return text + (f".{value.microsecond:06d}".rstrip("0") if value.microsecond else "")


def read_plain(
    settings: Settings,
    source: CsvSource | ParquetSource,
    offsets: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every row of the window (default: the source's current files), as `read_spark` gives
    them."""
    if offsets is None:
        offsets = source.offsets(settings, source.discover(settings, None))
    rows = []
    for batch in _batches(settings, source, offsets):
        for row in batch.to_pylist():
            rows.append(
                {k: spark_text(v) if isinstance(v, datetime) else v for k, v in row.items()}
            )
    return rows


def read_spark(
    spark: Any,
    settings: Settings,
    source: CsvSource | ParquetSource,
    offsets: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every row of the window read by Spark (one partition per file, collected in partition
    order); timestamps as UTC strings."""
    if offsets is None:
        offsets = source.offsets(settings, source.discover(settings, None))
    frame = source.read(spark, settings, offsets)
    columns = [
        f"CAST(`{f.name}` AS STRING) AS `{f.name}`"
        if f.dataType.typeName() == "timestamp"
        else f"`{f.name}`"
        for f in frame.schema.fields
    ]
    return [row.asDict() for row in frame.selectExpr(*columns).collect()]
