"""The one compute path: source → parse → quarantine → dedupe → transform.

Run, restatement and reconcile all compute a job's outputs here, for one window or for a
sequence of windows. The first valid occurrence of each dedupe key in source order (window,
unit, position) is kept, over the whole sequence and against `seen`, the keys earlier windows
kept (from the dedupe state sink) — so a window computed alone and the same window computed
inside a sequence give the same rows. A record whose dedupe key has a null part is quarantined
(`_keylookup.null_key_columns`), the same in every window and every sequence.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any

from pyspark import StorageLevel

from onceflow import _window_params as window_params
from onceflow._identifiers import spark_sql_name, spark_sql_string
from onceflow._keylookup import KEY_COL, SEEN_COL, SeenLookup, null_key_columns
from onceflow._plan_reruns import reruns_afresh
from onceflow._varying import varying
from onceflow.errors import ConfigurationError
from onceflow.job import Job, WindowContext, check_outputs
from onceflow.sources.base import RAW_TEXT_COLUMN, REASON_COLUMN, ArrowParse, BatchFunction
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession

    from onceflow.ledger import Window
    from onceflow.settings import Settings


@dataclass(frozen=True)
class Computed:
    """A computation's cached intermediates and its outputs (with WINDOW_COL if asked for).

    `parsed` is persisted (memory, then local disk) so every output and every sink reads it
    once, and so is `kept` unless it is `parsed` filtered by `kept_where` (SQL); `release`
    frees them.

    A plan for any window keeps its cache entries from window to window (`cache_kept`): its
    rows are dropped (`release`) and cached again (`persist`) in the very RDDs Spark made for
    them, so a query Spark planned once over them reads each window's rows, never planned
    again. `forget` drops the entries with the plan.
    """

    parsed: DataFrame
    kept: DataFrame
    outputs: dict[str, DataFrame]
    kept_where: str | None = None
    #: Planned with `slot`, and the plan holds for any window: every step takes the window from
    #: its parameters (`_window_params`), the transform read no `ctx.window_id` and the outputs
    #: read nothing but the window's rows.
    any_window: bool = False
    # The JVM RDDs holding the cached rows once found (`_cache_rdds`); empty: not yet, or the
    # session cannot give them (then the entries are dropped and made anew each window).
    _rdds: list[Any] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def counts_frame(self) -> DataFrame:
        """The window's counts as a measure of its write job (`sinks.writers.run_writers`): JSON
        objects of the rows read (`rows_in`), invalid and kept (two rows, or one).

        A union, not a join of the two counts: a join would broadcast one side in a Spark job
        of its own, before the window's write job. Kept rows that are parsed rows filtered are
        counted in the same aggregate (a union of two over one cache, Spark would merge into a
        subquery run as a job of its own)."""
        if self.kept_where is not None:
            return self.parsed.selectExpr(
                "to_json(named_struct('rows_in', count(1), 'invalid', "
                f"count({spark_sql_name(REASON_COLUMN)}), 'kept', count_if({self.kept_where})))"
                " AS result",
            )
        read = self.parsed.selectExpr(
            "to_json(named_struct('rows_in', count(1), 'invalid', "
            f"count({spark_sql_name(REASON_COLUMN)}))) AS result",
        )
        kept = self.kept.selectExpr(
            "to_json(named_struct('kept', count(1))) AS result",
        )
        return read.unionAll(kept)

    def _cached_frames(self) -> list[DataFrame]:
        return [self.parsed] if self.kept_where is not None else [self.parsed, self.kept]

    @property
    def cache_kept(self) -> bool:
        """Whether the cache entries stay from window to window (queries over them planned
        once stay right); found on first use."""
        if self.any_window and not self._rdds:
            self._rdds.extend(_cache_rdds(self._cached_frames()))
        return bool(self._rdds)

    def persist(self) -> None:
        """Cache the intermediates again after `release` (a plan reused for a new window)."""
        if self.cache_kept:
            level = _jvm_storage_level(self.parsed, StorageLevel.MEMORY_AND_DISK)
            for rdd in self._rdds:
                rdd.persist(level)
            return
        for df in self._cached_frames():
            df.persist(StorageLevel.MEMORY_AND_DISK)

    @property
    def cached(self) -> bool:
        if self.cache_kept:
            return any(rdd.getStorageLevel().isValid() for rdd in self._rdds)
        return bool(self.parsed.is_cached)

    def release(self) -> None:
        """Drop the cached rows (a plan for any window keeps its entries: see the class)."""
        if self.cache_kept:
            for rdd in self._rdds:
                rdd.unpersist(True)
            return
        self.forget()

    def forget(self) -> None:
        """Drop the cached rows and their cache entries."""
        self._rdds.clear()
        for df in reversed(self._cached_frames()):
            df.unpersist()


def _cache_rdds(frames: Sequence[DataFrame]) -> list[Any]:
    """The JVM RDDs that hold `frames`' cached rows (Spark builds them on first use, and every
    query planned over the frames reads these); empty if the session cannot give them."""
    from py4j.protocol import Py4JError

    try:
        manager = frames[0].sparkSession._jsparkSession.sharedState().cacheManager()
        rdds = []
        for df in frames:
            entry = manager.lookupCachedData(df._jdf)
            if entry.isEmpty():
                return []
            rdds.append(entry.get().cachedRepresentation().cacheBuilder().cachedColumnBuffers())
    except (Py4JError, AttributeError):  # another Spark's internals: entries made anew
        return []
    return rdds


def _jvm_storage_level(df: DataFrame, level: StorageLevel) -> Any:
    return df.sparkSession.sparkContext._getJavaStorageLevel(level)


def _parsed(
    spark: SparkSession,
    job: Job,
    settings: Settings,
    windows: Sequence[Window],
    lookup: SeenLookup | None,
    slot: int | None = None,
    in_order_ok: bool = True,
) -> tuple[DataFrame, _Marked]:
    """The windows' parsed rows, and which repeats of a key within the window the key lookup
    already marked seen: every one (`WHOLE`: no first-occurrence sort is needed), those within
    each read task's share (`TASKS`: only keys several tasks kept are left to compare), or
    none."""
    from pyspark.sql import functions as F

    parse = job.parse or (lambda raw: raw)
    source = job.source
    if slot is not None:
        if not isinstance(job.parse, ArrowParse) or (
            lookup is not None and not job.parse.keeps_order
        ):
            raise ConfigurationError(
                f"job {job.name}: only an order-keeping ArrowParse is planned once for any window."
            )
        fn, schema = job.parse.fn, job.parse.schema
        if lookup is not None:
            fn, schema = _chain(fn, _AnyWindowLookup(lookup)), lookup.ddl(schema)
        fn, schema = _chain(fn, _AnyWindowId()), f"{schema}, {WINDOW_COL} BIGINT"
        marked = _Marked.WHOLE if lookup is not None else _Marked.NONE
        return source.read_planned(spark, settings, fn, schema, slot), marked
    many = (
        source.read_many(spark, settings, [w.offsets for w in windows])
        if len(windows) > 1
        else None
    )
    if many is not None:
        raw, file_map = many
        positions = spark.createDataFrame(
            [(g, windows[p].window_id, local) for g, p, local in file_map],
            f"__global INT, {WINDOW_COL} BIGINT, __local INT",
        )
        parsed = parse(raw)
        if lookup is not None:
            parsed = parsed.mapInArrow(lookup, lookup.struct(parsed.schema))
        return (
            parsed.withColumnRenamed("_file_idx", "__global")
            .join(F.broadcast(positions), "__global")
            .drop("__global")
            .withColumnRenamed("__local", "_file_idx")
        ), _Marked.NONE
    frames = []
    marked = _Marked.NONE
    for w in windows:
        if isinstance(job.parse, ArrowParse):
            # The parse (and the key lookup) run in the source's own read step, which also
            # adds the window's id: as data, not a literal in the plan, so each window's plan
            # generates the same code and Spark compiles it once, not once per window.
            fn, schema = job.parse.fn, job.parse.schema
            if lookup is not None:
                # One window read in order by one task: its first occurrences are known
                # as the rows pass, so the lookup marks the repeats too. Read in order by
                # each of several tasks: the repeats within each task's share.
                marked = _marked_on_read(spark, job, settings, w, len(windows) == 1 and in_order_ok)
                if marked is not _Marked.NONE:
                    lookup = dataclasses.replace(lookup, in_order=True)
                fn, schema = _chain(fn, lookup), lookup.ddl(schema)
            fn, schema = _chain(fn, _WindowId(w.window_id)), f"{schema}, {WINDOW_COL} BIGINT"
            df = source.read_mapped(spark, settings, w.offsets, fn, schema)
        else:
            df = parse(source.read(spark, settings, w.offsets))
            if lookup is not None:
                df = df.mapInArrow(lookup, lookup.struct(df.schema))
            df = df.withColumn(WINDOW_COL, F.lit(w.window_id).cast("bigint"))
        frames.append(df)
    return reduce(lambda a, b: a.unionByName(b), frames), marked


class _Marked(enum.Enum):
    """Which repeats of a key within a window the key lookup marked as the rows passed."""

    NONE = "none"
    TASKS = "tasks"  # those within each read task's share
    WHOLE = "whole"  # every one: the window was read in order by one task


def _marked_on_read(
    spark: SparkSession, job: Job, settings: Settings, window: Window, alone: bool
) -> _Marked:
    """What the lookup can mark reading `window` (computed `alone`, with no `seen`)."""
    parse = job.parse
    if not alone or not isinstance(parse, ArrowParse) or not parse.keeps_order:
        return _Marked.NONE
    if job.source.reads_in_order(spark, settings, window.offsets):
        return _Marked.WHOLE
    if job.source.reads_in_runs(spark, settings, window.offsets):
        return _Marked.TASKS
    return _Marked.NONE


def _first_across_tasks(valid: DataFrame, keys: Sequence[str]) -> DataFrame:
    """`valid` (one window's rows, each read task's repeats already marked and left out) less
    the rows whose key another task kept at an earlier position.

    Only the keys several tasks kept are compared: their first positions are found by an
    aggregate of the key and position alone, and that small set is broadcast to the read's
    own partitions. The rows themselves are neither shuffled nor sorted (the first-occurrence
    `row_number` moves and sorts the whole window), and the key compares as it does there: by
    the key columns' values."""
    from pyspark.sql import functions as F

    position = F.expr(
        f"CAST({spark_sql_name('_file_idx')} AS BIGINT) * 4294967296"
        f" + {spark_sql_name('_source_line')}"
    )
    firsts = (
        valid.groupBy(*keys)
        .agg(F.min(position).alias(_FIRST), F.count(F.lit(1)).alias("__kept_by"))
        .where("__kept_by > 1")
        .drop("__kept_by")
    )
    return (
        valid.join(F.broadcast(firsts), list(keys), "left")
        .where(F.col(_FIRST).isNull() | (position == F.col(_FIRST)))
        .select(*valid.columns)
    )


# The first position of a key several read tasks kept (`_first_across_tasks`).
_FIRST = "__first_position"


def _chain(first: BatchFunction, then: BatchFunction) -> BatchFunction:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return then(first(batches))

    return run


@dataclass(frozen=True)
class _WindowId:
    """Adds WINDOW_COL, the window's id, to every batch."""

    window_id: int

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            ids = pa.repeat(pa.scalar(self.window_id, pa.int64()), batch.num_rows)
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, ids], schema=batch.schema.append(pa.field(WINDOW_COL, pa.int64()))
            )


@dataclass(frozen=True)
class _AnyWindowId:
    """`_WindowId` of the window the task is given."""

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _WindowId(int(window_params.current()["window_id"]))(batches)


@dataclass(frozen=True)
class _AnyWindowLookup:
    """`lookup` for the window the task is given: keys kept before it, and the keys staged by
    the windows not yet in the index; the window is read in order (`Source.read_planned`)."""

    lookup: SeenLookup

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        params = window_params.current()
        lookup = dataclasses.replace(
            self.lookup,
            before=int(params["window_id"]),
            staged=tuple(params["staged"]),
            in_order=True,
        )
        return lookup(batches)


def _transform(
    job: Job, rows: DataFrame, window_id: int, spark: SparkSession
) -> tuple[dict[str, DataFrame], _WatchedContext]:
    """The transform's outputs for one window, and the context it was given.

    `ctx.window_id_column()` reads WINDOW_COL, which a `select` or an aggregate may leave
    out; Spark then cannot resolve it. The transform (pure, so callable again) is then given
    a context whose column is the window's id as a constant.
    """
    from pyspark.errors import AnalysisException

    ctx = _WatchedContext(job.name, window_id)
    try:
        produced = dict(job.transform(rows, ctx))
        if ctx.window_column_used and not window_params.supported(spark):
            # Spark Connect analyses lazily: ask now, while the transform can be called again.
            for df in produced.values():
                df.schema  # noqa: B018
        return produced, ctx
    except AnalysisException as exc:
        if not ctx.window_column_used or WINDOW_COL not in str(exc):
            raise
    ctx = _WatchedContext(job.name, window_id, constant_column=True)
    return dict(job.transform(rows, ctx)), ctx


class _WatchedContext(WindowContext):
    """A WindowContext that notes whether the transform read `window_id` while planning (a
    plan that holds it as a constant holds for that window only). Read in a task (a UDF that
    keeps the context), it is the id of the window the task computes.

    It also notes whether `window_id_column` was used; with `constant_column`, that column is
    the window's id as a constant (which counts as reading `window_id`)."""

    def __init__(self, job: str, window_id: int, *, constant_column: bool = False) -> None:
        super().__init__(job, window_id)
        object.__setattr__(self, "_constant_column", constant_column)

    def __getattribute__(self, name: str) -> Any:
        if name == "window_id":
            in_task = window_params.task_window_id()
            if in_task is not None:
                return in_task
            object.__setattr__(self, "_window_id_read", True)
        return super().__getattribute__(name)

    def window_id_column(self) -> Column:
        from pyspark.sql import functions as F

        object.__setattr__(self, "_window_column_used", True)
        if self.__dict__.get("_constant_column", False):
            return F.lit(self.window_id).cast("bigint")
        return super().window_id_column()

    @property
    def window_id_read(self) -> bool:
        return bool(self.__dict__.get("_window_id_read", False))

    @property
    def window_column_used(self) -> bool:
        return bool(self.__dict__.get("_window_column_used", False))


def _check_deterministic(job: Job, outputs: Mapping[str, DataFrame]) -> None:
    """Raises ConfigurationError if an output of a job declared deterministic uses an
    expression whose value varies from one computation to the next (`_varying`)."""
    for name, df in sorted(outputs.items()):
        found = varying(df)
        if found:
            raise ConfigurationError(
                f"job {job.name}: it declares deterministic=True, but its output {name!r} uses "
                f"{', '.join(found)}, which gives other values each time the window is "
                "computed: a replay would give the sinks other rows than the first run wrote. "
                "Remove deterministic=True (each window's outputs are then computed once and "
                "staged for every sink and retry), or derive the value from the input. "
                "Nothing was written."
            )


def _reads_only_its_window(df: DataFrame) -> bool:
    """Every leaf of `df`'s plan is a range (the planned read's, or the transform's own): no
    table, file or rows that a plan made once would keep from its first window."""
    leaves = df._jdf.queryExecution().analyzed().collectLeaves()
    return all(leaves.apply(i).nodeName() == "Range" for i in range(leaves.size()))


def compute(
    spark: SparkSession,
    job: Job,
    settings: Settings,
    windows: Sequence[Window],
    *,
    seen: DataFrame | None = None,
    lookup: SeenLookup | None = None,
    window_column: bool = True,
    slot: int | None = None,
) -> Computed:
    """Compute `job`'s outputs for `windows` (in window order).

    Args:
        spark: The Spark session.
        job: The job.
        settings: Where the input is.
        windows: The windows, all with their input available.
        seen: Dedupe key columns plus `__seen_in`: keys whose first occurrence is in that
            (earlier or unreplayable) window; later occurrences are duplicates.
        lookup: Marks the rows whose key a window before the lookup's `before` kept (the key
            index), which are then duplicates; the kept rows carry the key as KEY_COL. Over
            several windows, repeats among them are found by the first-occurrence sort.
        window_column: Whether the outputs (the transform's and the quarantine output) get
            WINDOW_COL.
        slot: Plan for any one window (in a slot of its own; see `_window_params`): the
            window is read with `Source.read_planned`, and whatever the window's parameters
            say is what its jobs compute. `Computed.any_window` says whether the plan holds.

    Returns:
        The parsed and kept rows (cached, with WINDOW_COL) and every output, lazily.
    """
    from pyspark.sql import functions as F

    windows = sorted(windows, key=lambda w: w.window_id)
    if not windows:
        raise ConfigurationError(f"job {job.name}: nothing to compute (no windows given).")
    if slot is not None and len(windows) != 1:
        raise ConfigurationError("a plan for any window is made from one window.")
    # With `seen` too, the rows are joined with it after the lookup: never marked in order.
    parsed, marked = _parsed(spark, job, settings, windows, lookup, slot, seen is None)
    deduped = marked is _Marked.WHOLE
    for column in (REASON_COLUMN, RAW_TEXT_COLUMN):
        if column not in parsed.columns:
            parsed = parsed.withColumn(column, F.lit(None).cast("string"))
    if job.dedupe is not None:
        keys = list(job.dedupe.key)
        missing = [k for k in keys if k not in parsed.columns]
        if missing:
            raise ConfigurationError(
                f"job {job.name}: dedupe key {missing} is not a column of the parsed records."
            )
        # A record whose key has a null part has no key: quarantined, the one rule for it.
        rule = null_key_columns(keys, parsed.columns, (WINDOW_COL, KEY_COL, SEEN_COL))
        parsed = parsed.withColumns({name: F.expr(sql) for name, sql in rule.items()})
    parsed = parsed.persist(StorageLevel.MEMORY_AND_DISK)
    # Each DataFrame operation, and each Column built in Python, costs round trips to the JVM
    # on every window: filters are combined, SEEN_COL is dropped with KEY_COL, not on its
    # own, and expressions are SQL text, parsed in the JVM in one call.
    is_valid = f"{spark_sql_name(REASON_COLUMN)} IS NULL"
    if lookup is not None:
        is_valid = f"{is_valid} AND NOT {spark_sql_name(SEEN_COL)}"
    valid = parsed.where(is_valid)
    invalid = parsed.where(f"{spark_sql_name(REASON_COLUMN)} IS NOT NULL")
    if job.dedupe is not None and marked is _Marked.TASKS:
        valid = _first_across_tasks(valid, list(job.dedupe.key))
    elif job.dedupe is not None and not deduped:
        if seen is not None:
            valid = (
                valid.join(seen.select(*keys, "__seen_in"), keys, "left")
                .where(F.col("__seen_in").isNull() | (F.col(WINDOW_COL) < F.col("__seen_in")))
                .drop("__seen_in")
            )
        partition = ", ".join(spark_sql_name(k) for k in keys)
        order = ", ".join(spark_sql_name(c) for c in (WINDOW_COL, "_file_idx", "_source_line"))
        first = f"row_number() OVER (PARTITION BY {partition} ORDER BY {order})"
        valid = (
            valid.withColumn("__occurrence", F.expr(first))
            .where("__occurrence = 1")
            .drop("__occurrence")
        )
    # Kept rows after a sort are cached; a filter of the cached parsed rows is not worth it.
    kept = valid if deduped else valid.persist(StorageLevel.MEMORY_AND_DISK)
    parts: dict[str, list[DataFrame]] = {}
    for window in windows:
        # One window: every kept row is its own, so no per-window literal enters the plan. The
        # rows keep WINDOW_COL for `WindowContext.window_id_column`.
        mine = kept if len(windows) == 1 else kept.where(F.col(WINDOW_COL) == window.window_id)
        rows = mine.drop(KEY_COL, SEEN_COL)
        produced, ctx = _transform(job, rows, window.window_id, spark)
        any_window = slot is not None and not ctx.window_id_read
        for name, df in produced.items():
            if window_column:
                df = df.withColumn(WINDOW_COL, F.lit(window.window_id).cast("bigint"))
            parts.setdefault(name, []).append(df)
    if job.quarantine_sink is not None:
        parts.setdefault(job.sink(job.quarantine_sink).output, []).append(
            invalid.selectExpr(
                f"{spark_sql_string(job.name)} AS job",
                f"CAST({spark_sql_name(WINDOW_COL)} AS BIGINT) AS window_id",
                "`_source_file` AS source_file",
                "CAST(`_source_line` AS BIGINT) AS source_line",
                f"coalesce({spark_sql_name(RAW_TEXT_COLUMN)}, '') AS raw_line",
                f"{spark_sql_name(REASON_COLUMN)} AS reason",
                *([spark_sql_name(WINDOW_COL)] if window_column else []),
            )
        )
    outputs = {
        name: reduce(lambda a, b: a.unionByName(b), frames) for name, frames in parts.items()
    }
    try:
        check_outputs(job, outputs)
        if job.deterministic and window_params.supported(spark):
            _check_deterministic(job, outputs)
    except ConfigurationError:
        for df in (kept, parsed):
            df.unpersist()
        raise
    if slot is not None:
        # The cached rows are cached again from their plan's lineage each window: a result it
        # kept from the first (`_plan_reruns`) would be taken again.
        cached = [parsed] if deduped else [parsed, kept]
        any_window = (
            any_window
            and all(_reads_only_its_window(df) for df in outputs.values())
            and all(reruns_afresh(df) for df in cached)
        )
    else:
        any_window = False
    return Computed(
        parsed, kept, outputs, kept_where=is_valid if deduped else None, any_window=any_window
    )
