"""What Dagster's catalog shows of a sink: standard table metadata, the lineage table and the
freshness policy. Presentation only: the facts come from the core (`SinkGroup.table_facts`,
`onceflow.lineage`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from dagster import (
    FreshnessPolicy,
    MetadataValue,
    TableColumn,
    TableRecord,
    TableSchema,
)

from onceflow.job import Job
from onceflow.lineage import LineageRow
from onceflow.sinks import SinkSpec, TableFacts

# Dagster's standard metadata keys (`TableMetadataSet`, `UriMetadataSet`; not exported).
ROW_COUNT = "dagster/row_count"
COLUMN_SCHEMA = "dagster/column_schema"
URI = "dagster/uri"
# Windows shown in a materialisation's lineage table.
LINEAGE_WINDOWS = 20
# Dagster refuses freshness windows under a minute.
MIN_FRESHNESS_S = 60.0


def column_schema(columns: Sequence[tuple[str, str]]) -> TableSchema:
    return TableSchema(columns=[TableColumn(name, type_name) for name, type_name in columns])


def definition_metadata(sink: SinkSpec) -> dict[str, Any]:
    """Definition metadata of a sink asset: its declared columns, when the job declares them
    (a Delta sink's columns follow the transform and appear with its first materialisation)."""
    declared = sink.declared_columns()
    return {COLUMN_SCHEMA: column_schema(declared)} if declared else {}


def table_metadata(facts: TableFacts | None) -> dict[str, Any]:
    """`dagster/uri`, `dagster/column_schema` and `dagster/row_count` of a sink's table now."""
    if facts is None:
        return {}
    out: dict[str, Any] = {URI: MetadataValue.text(facts.uri)}
    if facts.columns:
        out[COLUMN_SCHEMA] = MetadataValue.table_schema(column_schema(facts.columns))
    if facts.row_count is not None:
        out[ROW_COUNT] = MetadataValue.int(facts.row_count)
        if facts.row_count_estimated:
            out["row_count_estimated"] = MetadataValue.bool(True)
    return out


LINEAGE_SCHEMA = TableSchema(
    columns=[
        TableColumn("window", "int", description="the window id"),
        TableColumn("input", "string", description="the window's offsets, short"),
        TableColumn("rows_in", "int", description="records read"),
        TableColumn("rows_out", "int", description="valid records kept"),
        TableColumn("duplicates", "int"),
        TableColumn("quarantined", "int"),
        TableColumn("rows", "int", description="rows this sink received for the window"),
        TableColumn("delta_version", "int", description="Delta version holding the window"),
        TableColumn("pg_xid", "string", description="PostgreSQL transaction that committed it"),
        TableColumn("checks", "string", description="latest quality checks covering it"),
        TableColumn("state", "string"),
    ]
)


def lineage_table(
    rows: Sequence[LineageRow], sink: SinkSpec, abandoned: Mapping[int, str] | None = None
) -> MetadataValue:
    """The sink's part of `onceflow.lineage` for the newest windows, newest first;
    `abandoned`: window → reason of the windows abandoned for this sink (a known gap)."""
    records = []
    for row in rows:
        if row.checks_passed is None:
            checks = "not checked yet"
        elif row.checks_passed:
            checks = f"passed ({row.checks})"
        else:
            checks = f"FAILED {row.checks_failed} of {row.checks}"
        state = "completed" if row.completed_at is not None else "pending"
        if row.skipped is not None:
            state = f"skipped: {row.skipped}"
        elif abandoned and row.window_id in abandoned:
            state = f"abandoned here (a known gap): {abandoned[row.window_id]}"
        records.append(
            TableRecord(
                {
                    "window": row.window_id,
                    "input": _offsets_text(row.offsets),
                    "rows_in": row.rows_in,
                    "rows_out": row.rows_out,
                    "duplicates": row.duplicates,
                    "quarantined": row.quarantined,
                    "rows": row.pg_rows.get(sink.name, row.rows_by_output.get(sink.output)),
                    "delta_version": row.delta_versions.get(sink.name),
                    "pg_xid": row.pg_xids.get(sink.name),
                    "checks": checks,
                    "state": state,
                }
            )
        )
    return MetadataValue.table(records, schema=LINEAGE_SCHEMA)


def _offsets_text(offsets: dict[str, Any]) -> str:
    parts = []
    for key, value in offsets.items():
        if isinstance(value, list):
            ends = f"{value[0]} … {value[-1]}" if len(value) > 1 else (value[0] if value else "")
            parts.append(f"{key}: {len(value)} ({ends})")
        else:
            parts.append(f"{key}: {value}")
    return "; ".join(parts)


def freshness_policy(job: Job) -> FreshnessPolicy:
    """The sink assets should be materialised within the job's `freshness_s` (at least a
    minute, Dagster's floor) whenever input keeps arriving."""
    return FreshnessPolicy.time_window(
        fail_window=timedelta(seconds=max(MIN_FRESHNESS_S, float(job.freshness_s)))
    )
