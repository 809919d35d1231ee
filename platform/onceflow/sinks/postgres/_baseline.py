"""An accumulating sink's verified state, kept so an incremental reconcile stays flat.

An accumulating table holds the sum of every window it committed, so checking it used to mean
recomputing every window ever. A reconcile that left the table equal to its expected state
keeps a copy of it (`onceflow.reconcile_baselines`: each key column's values and each
accumulated column's sums as one array, as `window_contributions` keeps a window's), with what
it stands for: the windows committed through `through` (their count and the sum of their ids,
read from the commit markers), the last restatement applied, the table's identity. The next
incremental reconcile expects the baseline plus the windows after `through`, recomputed; any
change behind the baseline's back that the platform made (a restatement, a window replayed
below `through`, the table replaced) makes it unusable, and every window is recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow._pgcopy import check_epoch_in
from onceflow.sinks.postgres._accumulate import _key_text, array_rows, target_table
from onceflow.sinks.postgres._folded import held_count_and_sum
from onceflow.sinks.postgres.spec import PostgresSink, spark_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def supported(spec: PostgresSink) -> bool:
    """Whether the sink's rows are its key and accumulated columns only (a column besides
    them takes the latest window's value, which a sum cannot carry)."""
    return spec.mode == "accumulate" and set(spec.columns) == set(spec.key) | set(spec.accumulate)


def _facts(spec: PostgresSink, job: str, through: sql.Composable) -> sql.Composable:
    """The markers' count and id sum through `through`, the last restatement, the table."""
    return sql.SQL(
        "{held}, (SELECT coalesce(max(seq), 0) FROM onceflow.restate_commits"
        "  WHERE job = {job} AND sink = {sink}),"
        " to_regclass(format('%I.%I', {schema}, {table}))::oid"
    ).format(
        held=held_count_and_sum(job, spec.name, through),
        job=sql.Literal(job),
        sink=sql.Literal(spec.name),
        schema=sql.Literal(spec.schema),
        table=sql.Literal(spec.table),
    )


def _where(spec: PostgresSink, job: str) -> sql.Composable:
    if spec.job_column is None:
        return sql.SQL("")
    return sql.SQL(" WHERE {} = {}").format(sql.Identifier(spec.job_column), sql.Literal(job))


def usable(conn: psycopg.Connection, spec: PostgresSink, job: str, through: int) -> bool:
    """Whether the sink's baseline stands for its committed windows through `through` and
    nothing the platform did since changed what they add up to."""
    if not supported(spec) or through <= 0:
        return False
    exists = conn.execute("SELECT to_regclass('onceflow.reconcile_baselines')").fetchone()
    if exists is None or exists[0] is None:
        return False
    row = conn.execute(
        sql.SQL(
            "SELECT b.through = {through} AND (b.held, b.held_sum, b.restated_seq, b.table_oid)"
            " = (SELECT {facts}) FROM onceflow.reconcile_baselines b"
            " WHERE b.job = {job} AND b.sink = {sink}"
        ).format(
            through=sql.Literal(through),
            facts=_facts(spec, job, sql.Literal(through)),
            job=sql.Literal(job),
            sink=sql.Literal(spec.name),
        )
    ).fetchone()
    return bool(row and row[0])


def rows(spark: SparkSession, conn: psycopg.Connection, spec: PostgresSink, job: str) -> DataFrame:
    """The baseline's rows, typed as the table's columns (keys cast back from their text)."""
    from pyspark.sql.types import _parse_datatype_string

    typed, unnest = array_rows(spec, "b", typed_amounts=True)
    found = conn.execute(
        sql.SQL(
            "SELECT {} FROM onceflow.reconcile_baselines b, {} WHERE b.job = %s AND b.sink = %s"
        ).format(typed, unnest),
        (job, spec.name),
    ).fetchall()
    order = [*spec.key, *spec.accumulate]
    by_name: list[dict[str, Any]] = [dict(zip(order, r, strict=True)) for r in found]
    schema = _parse_datatype_string(spark_schema(spec.columns))
    columns = [f.name for f in schema.fields]
    return spark.createDataFrame([tuple(r[c] for c in columns) for r in by_name], schema)


def keep(conn: psycopg.Connection, spec: PostgresSink, job: str, through: int, epoch: int) -> None:
    """In `conn`'s transaction: keep the table as it is now as the sink's baseline through
    `through`; FencedError if a run took the job over since the reconcile compared it."""
    check_epoch_in(conn, job, epoch)
    conn.execute(
        "DELETE FROM onceflow.reconcile_baselines WHERE job = %s AND sink = %s", (job, spec.name)
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO onceflow.reconcile_baselines (job, sink, through, held, held_sum,"
            " restated_seq, table_oid, keys, amounts)"
            " SELECT {job}, {sink}, {through}, {facts},"
            " ARRAY[{keys}]::text[], ARRAY[{amounts}]::numeric[] FROM {table} AS t{where}"
        ).format(
            job=sql.Literal(job),
            sink=sql.Literal(spec.name),
            through=sql.Literal(through),
            facts=_facts(spec, job, sql.Literal(through)),
            keys=sql.SQL(", ").join(
                sql.SQL("coalesce(array_agg({}), '{{}}')").format(_key_text(spec, k))
                for k in spec.key
            ),
            amounts=sql.SQL(", ").join(
                sql.SQL("coalesce(array_agg({}::numeric), '{{}}')").format(sql.Identifier(a))
                for a in spec.accumulate
            ),
            table=target_table(spec),
            where=_where(spec, job),
        )
    )
