"""What a reconcile compares in one PostgreSQL sink: the expected rows its mode leaves (with an
accumulating sink's verified state, `_baseline`), the table's rows narrowed to the windows
compared, and the sink's verified state kept after a repair."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onceflow.sinks.base import ReconcileScope, SinkContext, SinkReconcile
from onceflow.sinks.postgres import _baseline
from onceflow.sinks.postgres._expected import expected_rows
from onceflow.sinks.postgres._reconcile import Narrow, reconcile_postgres
from onceflow.sinks.postgres.spec import PostgresSink
from onceflow.storage import Location
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame, SparkSession


# Runs a query on the sink group's session, retried: (what it does, the query) -> its result.
Read = Callable[[str, Callable[[Any], Any]], Any]


def reconcile_sink(
    spark: SparkSession,
    spec: PostgresSink,
    expected: DataFrame | None,
    scope: ReconcileScope,
    *,
    committed: frozenset[int],
    ctx: SinkContext,
    read: Read,
    epoch: int | None,
    run_id: str,
    workdir: Location,
) -> SinkReconcile:
    """`PostgresGroup.reconcile` of one sink, which holds `committed` among `scope.windows`."""
    from pyspark.sql import functions as F

    sink, job = spec.name, ctx.job.name
    accumulate = spec.mode == "accumulate"
    window_col = spec.window_column
    if window_col is None and scope.unverifiable:
        return SinkReconcile(None, "holds rows of unverifiable windows", committed, frozenset())
    # An accumulating sink compared from a verified point adds its baseline's rows.
    base = None
    if accumulate and scope.since > 0:
        base = read(
            f"read the verified state of {sink}",
            lambda conn: _baseline.rows(spark, conn, spec, job),
        )
    since = scope.since if window_col is not None or base is not None else 0
    compare = frozenset(w for w in committed if w > since and w not in scope.unverifiable)
    # An upsert's later windows overwrite keys of earlier ones, compared or not: its
    # expected rows come from every window it can recompute (`narrow_upsert`).
    scoped_upsert = spec.mode == "upsert" and window_col is not None
    windows = (
        frozenset(w for w in committed if w not in scope.unverifiable) if scoped_upsert else compare
    )
    expected = expected_rows(spark, spec, expected, windows, keep_window=scoped_upsert, base=base)

    def compared_rows(expected: DataFrame, actual: DataFrame) -> tuple[DataFrame, DataFrame]:
        if window_col is None:
            return expected, actual
        column = F.col(window_col)
        keep = column > since
        if scope.unverifiable:
            keep = keep & ~column.isin(sorted(scope.unverifiable))
        return expected, actual.where(column.isNull() | keep)

    narrow = (
        narrow_upsert(spec.key, window_col, since, scope.unverifiable, spec.order_by)
        if scoped_upsert and window_col is not None
        else compared_rows
    )
    diff = reconcile_postgres(
        spark,
        ctx.dsn,
        ctx.ledger,
        job,
        spec,
        expected,
        narrow=narrow,
        key=spec.key,
        workdir=workdir,
        epoch=epoch,
        job_filter=job,
        # Rows of windows verified before are not read, where the compare keeps none.
        rows_after=(
            (window_col, since)
            if window_col is not None and since > 0 and not scoped_upsert and not accumulate
            else None
        ),
    )
    if epoch is not None and _baseline.supported(spec) and not scope.unverifiable:
        # The table now is what its committed windows add up to: the next incremental
        # reconcile starts from it.
        through = max(compare, default=since)
        ctx.ledger.write(
            f"keep the verified state of {sink}",
            lambda conn: _baseline.keep(conn, spec, job, through, epoch),
        )
    return SinkReconcile(
        diff,
        None,
        committed,
        compare if window_col is not None else frozenset(),
        tuple(diff.samples(window_col, keyed=bool(spec.key))),
    )


def reconcile_since(
    spec: PostgresSink, job: str, verified: int, *, replaced: bool, read: Read
) -> int:
    """`PostgresGroup.reconcile_since` of one sink (`replaced`: its table was created again)."""
    sink = spec.name
    if verified <= 0 or replaced:
        return 0
    if spec.mode == "accumulate":
        usable = read(
            f"check the verified state of {sink}",
            lambda conn: _baseline.usable(conn, spec, job, verified),
        )
        return verified if usable else 0
    # An upsert's row with the greatest `order_by` may come from any earlier window.
    if spec.window_column is None or (spec.mode == "upsert" and spec.order_by is not None):
        return 0
    return verified


def narrow_upsert(
    key: Sequence[str],
    window_column: str,
    since: int,
    unverifiable: frozenset[int],
    order_by: str | None = None,
) -> Narrow:
    """Narrow an upsert sink's comparison the way the run applies it: the last window's row
    per key wins (with `order_by`, the greatest value of that column, then the last window),
    also over windows this reconcile does not compare. "Newer" below is in that order.

    `expected` holds the latest row per key of every verifiable window the sink holds, with
    its window in `WINDOW_COL`. A held row of a window left alone (its input gone, or verified
    before in incremental mode) is *outside*. Then, per key:

    - an outside row at least as new as the expected row stands: neither side is compared
      (a later window whose input is gone overwrote the key);
    - an outside row older than the expected row is compared with it (a later window should
      have overwritten it): the repair replaces it;
    - otherwise rows are compared as they are, an expected row of a window verified before
      only where the sink holds a compared row for its key.
    """
    keys = list(key)

    def narrow(expected: DataFrame, actual: DataFrame) -> tuple[DataFrame, DataFrame]:
        from pyspark.sql import functions as F

        held = F.col(window_column)

        def newness(window: Column) -> Column:
            if order_by is None:
                return window
            # A null `order_by` is the least (the first field orders it before any value).
            return F.struct(F.col(order_by).isNotNull(), F.col(order_by), window)

        outside = held.isNotNull() & (held <= since)
        if unverifiable:
            outside = outside | held.isin(sorted(unverifiable))
        marked = actual.withColumn("__outside", outside)
        newest_outside = (
            marked.where("__outside").groupBy(*keys).agg(F.max(newness(held)).alias("__wo"))
        )
        inside_keys = (
            marked.where(~F.col("__outside")).select(*keys).distinct()
            .withColumn("__in", F.lit(True))
        )  # fmt: skip
        we, wo = F.col(WINDOW_COL), F.col("__wo")
        joined = expected.join(newest_outside, keys, "left").join(inside_keys, keys, "left")
        newer = newness(we) > wo
        kept = joined.where(F.col("__in").isNotNull() | ((wo.isNull() | newer) & (we > since)))
        replaced = kept.where(wo.isNotNull()).select(*keys)
        compared = marked.where(~F.col("__outside")).unionByName(
            marked.where("__outside").join(replaced, keys, "left_semi")
        )
        return kept.drop("__wo", "__in"), compared.drop("__outside")

    return narrow
