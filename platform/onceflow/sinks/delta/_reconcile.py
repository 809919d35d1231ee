"""Reconcile a Delta sink: diff its snapshot with the expected rows, repair in one commit.

The repair is one Delta commit made against the snapshot the diff read, with
`max_commit_retries=0`: it removes every file holding a row that must go and adds the files
rewritten without those rows plus the missing copies. If anyone commits in between, the commit
fails and nothing changes (reconcile again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import RemoveAction

from onceflow._delta_read import read_snapshot, spark_schema
from onceflow._diff import Diff, multiset_diff
from onceflow.sinks.base import ReconcileScope, SinkReconcile
from onceflow.sinks.delta.table import DeltaTableSink
from onceflow.storage import Location
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.sink_state import SinkState

_FILE_COL = "__onceflow_file"


def _local(uri: str) -> str:
    """A file URI or path as a resolved local path, so Spark's and Delta's spellings meet."""
    parsed = urlparse(uri)
    path = unquote(parsed.path) if parsed.scheme in ("file", "") else uri
    return str(Path(path).resolve()) if parsed.scheme in ("file", "") else path


def reconcile_delta(
    spark: SparkSession,
    sink: DeltaTableSink,
    table: DeltaTable,
    expected: DataFrame,
    *,
    prepare_actual: Callable[[DataFrame], DataFrame],
    workdir: Location,
    epoch: int | None,
    run_id: str,
    rows_after: tuple[str, int] | None = None,
) -> Diff:
    """Diff the table (keyless: whole rows, counted) with `expected`; repair if `epoch` is set.

    Args:
        spark: The Spark session.
        sink: The sink.
        table: The table, loaded at the version to compare (and to commit against).
        expected: The expected rows with the table's columns and types.
        prepare_actual: Narrows the actual rows to those under comparison.
        workdir: A folder for the diff.
        epoch: The reconcile's epoch; None for a dry run.
        run_id: Recorded in the repair commit.
        rows_after: (column, value): only files that may hold rows `prepare_actual` keeps,
            those of the column null or above the value, are read (by their statistics).
    """
    snapshot = read_snapshot(spark, table, sink.path, file_column=_FILE_COL, rows_after=rows_after)
    columns = [c for c in snapshot.columns if c != _FILE_COL]
    diff = multiset_diff(
        expected.select(*columns),
        prepare_actual(snapshot).select(*columns),
        columns,
        (),
        workdir / f"diff_{sink.sink}",
    )
    if epoch is None or diff.empty:
        return diff
    _repair(sink, table, snapshot, diff, columns, epoch, run_id)
    return diff


def _repair(
    sink: DeltaTableSink,
    table: DeltaTable,
    snapshot: DataFrame,
    diff: Diff,
    columns: list[str],
    epoch: int,
    run_id: str,
) -> None:
    from pyspark.sql import functions as F

    gone = diff.deletes().select(*[F.col(c).alias(f"__r_{c}") for c in columns])
    same_row = None
    for c in columns:
        term = F.col(c).eqNullSafe(F.col(f"__r_{c}"))
        same_row = term if same_row is None else same_row & term
    assert same_row is not None
    hit = [
        r[0]
        for r in snapshot.join(gone, same_row, "left_semi").select(_FILE_COL).distinct().collect()
    ]
    kept = (
        snapshot.where(F.col(_FILE_COL).isin(hit))
        .join(gone, same_row, "left_anti")
        .select(*columns)
    )
    adds = sink.write_files(kept.unionByName(diff.inserts().select(*columns)), 0, epoch)
    by_path = {
        _local(str(sink.path / unquote(a["path"]))): a
        for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()
    }
    now_ms = int(time.time() * 1000)
    removes = []
    for uri in hit:
        add = by_path[_local(uri)]
        removes.append(
            RemoveAction(
                path=add["path"],
                data_change=True,
                deletion_timestamp=now_ms,
                size=add["size_bytes"],
                partition_values={},
            )
        )
    sink.commit_repair(
        table,
        removes,
        adds,
        epoch=epoch,
        run_id=run_id,
        counts={"missing": diff.missing, "extra": diff.extra},
    )


def reconcile_sink(
    sink_table: DeltaTableSink,
    state: SinkState,
    spark: SparkSession,
    sink: str,
    expected: DataFrame | None,
    scope: ReconcileScope,
    *,
    epoch: int | None,
    run_id: str,
    workdir: Location,
) -> SinkReconcile:
    """`DeltaGroup.reconcile`: compare the table with its expected rows, and repair it (the
    restatements the table then holds recorded in `state`)."""
    from pyspark.sql import functions as F

    if not sink_table.exists():
        return SinkReconcile(None, "the Delta table does not exist yet", frozenset(), frozenset())
    table = sink_table.table()
    through = table.transaction_version(sink_table.app_id) or 0
    committed = frozenset(w for w in scope.windows if w <= through)
    schema = spark_schema(table)
    columns = [f.name for f in schema.fields]  # type: ignore[attr-defined]
    window_col = "_window_id" if "_window_id" in columns else None
    if window_col is None and scope.unverifiable:
        return SinkReconcile(None, "holds rows of unverifiable windows", committed, frozenset())
    since = scope.since if window_col else 0
    compare = frozenset(w for w in committed if w > since and w not in scope.unverifiable)
    if expected is None:
        expected = spark.createDataFrame([], schema).withColumn(  # type: ignore[arg-type]
            WINDOW_COL, F.lit(None).cast("bigint")
        )
    expected = expected.where(
        F.col(WINDOW_COL).isin(sorted(compare)) if compare else F.lit(False)
    ).select(*[F.col(f.name).cast(f.dataType) for f in schema.fields])  # type: ignore[attr-defined]

    def prepare_actual(actual: DataFrame) -> DataFrame:
        if window_col is None:
            return actual
        column = F.col(window_col)
        keep = column > since
        if scope.unverifiable:
            keep = keep & ~column.isin(sorted(scope.unverifiable))
        return actual.where(column.isNull() | keep)

    diff = reconcile_delta(
        spark,
        sink_table,
        table,
        expected,
        prepare_actual=prepare_actual,
        workdir=workdir,
        epoch=epoch,
        run_id=run_id,
        # A history of windows verified before is not read again.
        rows_after=(window_col, since) if window_col is not None and since > 0 else None,
    )
    if epoch is not None and window_col is not None and not scope.unverifiable:
        # Its rows now are what every restatement made them: record them as applied.
        sink_table.record_restated(state.restated_through(), epoch)
    return SinkReconcile(
        diff,
        None,
        committed,
        compare if window_col else frozenset(),
        tuple(diff.samples(window_col, keyed=False)),
    )
