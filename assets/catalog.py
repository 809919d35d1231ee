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

from onceflow import Job, SinkSpec
from onceflow.ops import LineageRow, TableFacts

# Dagster's standard metadata keys (`TableMetadataSet`, `UriMetadataSet`; not exported).
ROW_COUNT = "dagster/row_count"
COLUMN_SCHEMA = "dagster/column_schema"
URI = "dagster/uri"
# `schema.table` for PostgreSQL, the table's folder under the lake root for Delta (its location
# is `dagster/uri`): from the job's definition, never the connection, so never credentials.
TABLE_NAME = "dagster/table_name"
# Windows shown in a materialisation's lineage table.
LINEAGE_WINDOWS = 20
# Dagster refuses freshness windows under a minute.
MIN_FRESHNESS_S = 60.0


def column_schema(columns: Sequence[tuple[str, str]]) -> TableSchema:
    return TableSchema(columns=[TableColumn(name, type_name) for name, type_name in columns])


def definition_metadata(sink: SinkSpec) -> dict[str, Any]:
    """Definition metadata of a sink asset: its table's name, and its declared columns when
    the job declares them (a Delta sink's columns follow the transform and appear with its
    first materialisation)."""
    declared = sink.declared_columns()
    name = sink.table_name
    return {
        **({TABLE_NAME: name} if name else {}),
        **({COLUMN_SCHEMA: column_schema(declared)} if declared else {}),
    }


def table_metadata(sink: SinkSpec, facts: TableFacts | None) -> dict[str, Any]:
    """`dagster/table_name`, `dagster/uri`, `dagster/column_schema` and `dagster/row_count` of
    a sink's table now."""
    name = sink.table_name
    out: dict[str, Any] = {TABLE_NAME: MetadataValue.text(name)} if name else {}
    if facts is None:
        return out
    out[URI] = MetadataValue.text(facts.uri)
    if facts.columns:
        out[COLUMN_SCHEMA] = MetadataValue.table_schema(column_schema(facts.columns))
    if facts.row_count is not None:
        out[ROW_COUNT] = MetadataValue.int(facts.row_count)
        if facts.row_count_estimated:
            out["row_count_estimated"] = MetadataValue.bool(True)
    return out


# Few, narrow columns, so the table fits the asset page. The full row of each window (every
# sink's commit, the counts, the latest checks) is in `lineage_view`'s query and `onceflow
# status JOB --json`. No column for checks: the table is written when a window commits, before
# the checks run; the quality check's own result (`through_window`) says what it covered.
LINEAGE_SCHEMA = TableSchema(
    columns=[
        TableColumn("window", "int", description="the window id"),
        TableColumn("input", "string", description="the window's input, short"),
        TableColumn("rows_in", "int", description="records read"),
        TableColumn("rows", "int", description="rows this sink received for the window"),
        TableColumn(
            "commit", "string", description="Delta version, or PostgreSQL transaction, holding it"
        ),
        TableColumn("state", "string"),
    ]
)
# Longest text of the input column; longer offsets are cut (the full ones are in the view).
INPUT_CHARS = 40


def lineage_table(
    rows: Sequence[LineageRow], sink: SinkSpec, abandoned: Mapping[int, str] | None = None
) -> MetadataValue:
    """The sink's part of `onceflow.lineage` for the newest windows, newest first;
    `abandoned`: window → reason of the windows abandoned for this sink (a known gap)."""
    records = []
    for row in rows:
        state = "completed" if row.completed_at is not None else "pending"
        if row.skipped is not None:
            state = f"skipped: {row.skipped}"
        elif abandoned and row.window_id in abandoned:
            state = f"abandoned here (a known gap): {abandoned[row.window_id]}"
        version = row.data_versions.get(sink.name)
        ref = row.commit_refs.get(sink.name)
        commit = f"v{version}" if version is not None else (f"commit {ref}" if ref else None)
        records.append(
            TableRecord(
                {
                    "window": row.window_id,
                    "input": _offsets_text(row.offsets),
                    "rows_in": row.rows_in,
                    "rows": row.rows_committed.get(sink.name, row.rows_by_output.get(sink.output)),
                    "commit": commit,
                    "state": state,
                }
            )
        )
    return MetadataValue.table(records, schema=LINEAGE_SCHEMA)


def lineage_view(job: str) -> MetadataValue:
    """Where the full lineage of `job` is: every column of every window, checks included."""
    return MetadataValue.md(
        f"`onceflow status {job} --json` (its `lineage`), or the PostgreSQL view "
        f"`onceflow.lineage`, rows with `job` = `{job}`"
    )


def _offsets_text(offsets: dict[str, Any]) -> str:
    """A window's offsets in a few words: a list as its length and ends (file names without
    their folders), cut to `INPUT_CHARS`."""
    parts = []
    for key, value in offsets.items():
        if isinstance(value, list):
            names = [str(v).rsplit("/", 1)[-1] for v in value]
            ends = f"{names[0]} … {names[-1]}" if len(names) > 1 else (names[0] if names else "")
            parts.append(f"{key}: {len(value)} ({ends})" if len(value) > 1 else f"{key}: {ends}")
        else:
            parts.append(f"{key}: {value}")
    text = "; ".join(parts)
    return text if len(text) <= INPUT_CHARS else text[: INPUT_CHARS - 1] + "…"


def freshness_policy(job: Job) -> FreshnessPolicy:
    """The sink assets should be materialised within the job's `freshness_s` (at least a
    minute, Dagster's floor) whenever input keeps arriving."""
    return FreshnessPolicy.time_window(
        fail_window=timedelta(seconds=max(MIN_FRESHNESS_S, float(job.freshness_s)))
    )
