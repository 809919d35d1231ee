"""Partition writers: what sinks write on the executors, all of a window in one Spark job.

Each sink group says what it writes for a window as `PartitionWriter`s (a Delta group: Parquet
files into its table; a PostgreSQL group: a COPY into a staging table per sink). `run_writers`
feeds every partition of every output to the writers of that output in one pass and one Spark
job, and brings back to the driver only each writer's small result per partition (file names,
sizes, row counts) — never the rows.

Several outputs go to the Python workers as one frame: each output's rows packed into a struct
column of its own, tagged with the output's number, in a union of the outputs. So a window
builds one `mapInArrow` UDF, not one per output (each costs the driver about 30 round trips to
the JVM, and the task a Python evaluation of its own), and the worker splits each batch by tag.

The same job computes the window's *measures* (`run_writers`' `measures`): small aggregates
such as the rows read, invalid and kept, each a frame of JSON objects, brought back beside the
writers' results (`WriteResults.measured`) without a Spark job of their own.

A run whose windows share one plan (`_window_params`) builds that frame once per slot too
(`WritersPlan`): a writer names what differs from window to window (a staging table, a folder)
in `window_fields`, and the task takes those from the window's parameters.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import reduce
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from onceflow._identifiers import spark_sql_name, spark_sql_string
from onceflow._plan_reruns import reruns_afresh

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.storage import Location

_RESULT_SCHEMA = "writer STRING, result STRING"
# The window parameter holding a `WritersPlan`'s writer values.
WRITERS_PARAM = "writers"
# The tag column of the union of outputs, and the prefix of their struct columns.
_TAG = "__writers_output"
# In the job's `(writer, result)` rows, a measure's rows are under this prefix and its name.
_MEASURE = "\x00measure:"
# How a writer's failure on an executor reads in the Spark error the driver gets, so the driver
# tells it from the computation's own errors (`failed_writer`).
_FAILED = "onceflow writer failed: "
_FAILED_PATTERN = re.compile(re.escape(_FAILED) + r"(\S+) \((\w+)\)")


class WriterFailed(RuntimeError):
    """A writer's own failure on an executor (its retries spent); its message names the writer
    and the error's type, never values (the error is chained for the worker's log)."""

    def __init__(self, writer: str, error: BaseException) -> None:
        super().__init__(f"{_FAILED}{writer} ({type(error).__name__})")


@contextlib.contextmanager
def _as_writer(key: str) -> Iterator[None]:
    try:
        yield
    except WriterFailed:
        raise
    except Exception as exc:
        raise WriterFailed(key, exc) from exc


def failed_writer(error: BaseException) -> str | None:
    """`writer (ErrorType)` when `error` (a failed Spark job) is a writer's failure; None when
    the job failed elsewhere (the computation of its rows, the cluster)."""
    found = _FAILED_PATTERN.search(str(error))
    return f"{found[1]} ({found[2]})" if found else None


class PartitionHandle(ABC):
    """One writer's work on one partition (made on the executor, never pickled)."""

    @abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Take the next non-empty batch of the partition."""

    @abstractmethod
    def close(self) -> dict[str, Any]:
        """Finish the partition's write; return a small JSON-able result (always `rows`)."""


class PartitionWriter(ABC):
    """A picklable description of a write that every partition of one output takes part in.

    Attributes:
        key: Unique among the writers of one `run_writers` call; results come back under it.
        output: The output (a transform output's name) whose rows it writes.
    """

    key: str
    output: str
    #: The attributes that differ from window to window (a staging table's name, a folder). A
    #: writers' step planned once (`WritersPlan`) is reused for a later window whose writers
    #: differ in these only; its tasks take them from the window's parameters.
    window_fields: ClassVar[tuple[str, ...]] = ()

    def window_values(self) -> dict[str, Any]:
        """This window's values of `window_fields` (JSON-able)."""
        return {name: getattr(self, name) for name in self.window_fields}

    def for_window(self, values: Mapping[str, Any]) -> PartitionWriter:
        """A copy with `values` for its `window_fields`."""
        twin = copy.copy(self)
        for name in self.window_fields:
            setattr(twin, name, values[name])
        return twin

    def same_plan(self, other: PartitionWriter) -> bool:
        """Whether `other` writes as this one does but for its `window_fields`."""

        def rest(writer: PartitionWriter) -> dict[str, Any]:
            return {k: v for k, v in vars(writer).items() if k not in writer.window_fields}

        return type(other) is type(self) and rest(other) == rest(self)

    @abstractmethod
    def open(self, partition: int) -> PartitionHandle:
        """Start writing partition `partition` (called on the executor)."""

    def columns(self, available: Sequence[str]) -> Sequence[str] | None:
        """The columns it needs (None: all of them); every writer of an output gets the same
        batches, so an output's frame is narrowed to what its writers need together."""
        return None


def _partition_function(
    planned: Sequence[Sequence[PartitionWriter]], *, tagged: bool, plan: str | None = None
) -> Any:
    """The `mapInArrow` function that feeds a partition's batches to the writers.

    Untagged, one group takes every batch. Tagged (the union of outputs), group `i` takes the
    rows tagged `i`, unpacked from their struct column. With `plan` (a `WritersPlan`'s id),
    the writers take their `window_fields` from the window's parameters."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        groups = planned if plan is None else _for_window(planned, plan)
        handles: list[list[PartitionHandle]] = []
        for group in groups:
            handles.append([])
            for writer in group:
                with _as_writer(writer.key):
                    handles[-1].append(writer.open(partition))
        # The batches are pulled outside any writer's guard: an error computing them is the
        # computation's, not a writer's.
        for batch in batches:
            for i, (group, group_handles) in enumerate(zip(groups, handles, strict=True)):
                rows = batch
                if tagged:
                    rows = batch.filter(pc.equal(batch.column(_TAG), i))
                    rows = pa.RecordBatch.from_struct_array(rows.column(f"{_TAG}_{i}"))
                if rows.num_rows:
                    for writer, handle in zip(group, group_handles, strict=True):
                        with _as_writer(writer.key):
                            handle.write(rows)
        writers = [writer for group in groups for writer in group]
        closed = close_all(
            [h for group_handles in handles for h in group_handles],
            [w.key for w in writers],
        )
        results = [json.dumps(result) for result in closed]
        yield pa.RecordBatch.from_pydict(
            {"writer": [w.key for w in writers], "result": results},
            schema=pa.schema([("writer", pa.string()), ("result", pa.string())]),
        )

    return run


def _for_window(
    groups: Sequence[Sequence[PartitionWriter]], plan: str
) -> list[list[PartitionWriter]]:
    """`groups`' writers with the window's values of their `window_fields`, from the parameters
    of the window whose task runs this."""
    from onceflow import _window_params

    given = _window_params.current().get(WRITERS_PARAM)
    if given is None or given.get("plan") != plan:
        # Never the values a plan was first built with: those name another window's tables.
        raise RuntimeError(
            f"the writers' step planned as {plan} ran without its window's writer values."
        )
    values = iter(given["values"])
    return [[writer.for_window(next(values)) for writer in group] for group in groups]


def close_all(
    handles: Sequence[PartitionHandle], keys: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Close `handles` at once, each in a thread of its own; their results in order.

    A handle's close is mostly a wait (a COPY's server ingesting the rows, a file's last
    upload): one after another, those waits add up at the end of the window's one task, while
    each other process idles. Every close runs to its end; the first failure is raised (a
    `WriterFailed` naming its writer, given the writers' `keys`)."""

    def close(i: int) -> dict[str, Any]:
        if keys is None:
            return handles[i].close()
        with _as_writer(keys[i]):
            return handles[i].close()

    if len(handles) < 2:
        return [close(i) for i in range(len(handles))]
    with ThreadPoolExecutor(len(handles), thread_name_prefix="onceflow-close") as pool:
        futures = [pool.submit(close, i) for i in range(len(handles))]
    return [f.result() for f in futures]


def _needed(df: DataFrame, group: Sequence[PartitionWriter]) -> list[str]:
    """The columns of `df` that `group`'s writers need together, in their order."""
    columns = df.columns
    needed: list[str] = []
    for writer in group:
        wanted = writer.columns(columns)
        needed += [c for c in (wanted if wanted is not None else columns) if c not in needed]
    return needed


@dataclass
class WriteResults:
    """What one write job brought back to the driver.

    Attributes:
        written: Each writer's results by its key, one per partition of its output.
        measured: Each measure's values by its name, its rows' JSON objects merged.
    """

    written: dict[str, list[dict[str, Any]]]
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_writers(
    outputs: Mapping[str, DataFrame],
    writers: Sequence[PartitionWriter],
    measures: Mapping[str, DataFrame] | None = None,
) -> WriteResults:
    """Write every output with its writers, and compute `measures`, in one Spark job.

    Args:
        outputs: The frames, by output name.
        writers: The writers.
        measures: Aggregates by name, each a frame of one string column of JSON objects.
    """
    return _collect(_writers_frame(outputs, writers, measures or {}), writers)


def _writers_frame(
    outputs: Mapping[str, DataFrame],
    writers: Sequence[PartitionWriter],
    measures: Mapping[str, DataFrame],
    plan: str | None = None,
) -> DataFrame | None:
    """The frame of `run_writers`' one Spark job (None: nothing to run)."""
    keys = [w.key for w in writers]
    if len(set(keys)) != len(keys) or any(k.startswith(_MEASURE) for k in keys):
        raise ValueError(f"writer keys must be unique names, got {keys}")
    by_output = _by_output(writers)
    frames = []
    if len(by_output) == 1:
        [(name, group)] = by_output.items()
        df = outputs[name]
        needed = _needed(df, group)
        if needed != df.columns:  # a select is one more operation to plan
            df = df.select(*needed)
        function = _partition_function([group], tagged=False, plan=plan)
        frames.append(df.mapInArrow(function, _RESULT_SCHEMA))
    elif by_output:
        groups = list(by_output.items())
        tagged = [
            outputs[name].selectExpr(
                f"{i} AS {_TAG}",
                "struct({}) AS {}".format(
                    ", ".join(spark_sql_name(c) for c in _needed(outputs[name], group)),
                    spark_sql_name(f"{_TAG}_{i}"),
                ),
            )
            for i, (name, group) in enumerate(groups)
        ]
        union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), tagged)
        function = _partition_function([g for _, g in groups], tagged=True, plan=plan)
        frames.append(union.mapInArrow(function, _RESULT_SCHEMA))
    for name, measure in measures.items():
        [column] = measure.columns
        frames.append(
            measure.selectExpr(
                f"{spark_sql_string(_MEASURE + name)} AS writer",
                f"{spark_sql_name(column)} AS result",
            )
        )
    return reduce(lambda a, b: a.unionAll(b), frames) if frames else None


def _collect(frame: DataFrame | None, writers: Sequence[PartitionWriter]) -> WriteResults:
    results = WriteResults({w.key: [] for w in writers})
    if frame is None:
        return results
    for row in frame.collect():
        name, value = row["writer"], json.loads(row["result"])
        if name.startswith(_MEASURE):
            results.measured.setdefault(name.removeprefix(_MEASURE), {}).update(value)
        else:
            results.written.setdefault(name, []).append(value)
    return results


class WritersPlan:
    """`run_writers`' frame built once and run again for later windows of a run whose
    outputs share one plan (the same frames, their steps reading the window from its
    parameters). The writers are grouped by output in the order of the writers it was built
    with; a later window's writers must match them but for their `window_fields`
    (`fits`), and its Spark job must run with `params` among the window's parameters.

    Where the frames' cache entries stay from window to window (`run`'s `cache_kept`), the
    query is planned once: each run executes the same physical plan, which reads the window's
    rows cached again in the same entries. Otherwise each run is a new query over the same
    analysed plan (`alias`), so Spark plans it again against the cache as it is then; what is
    saved then is building the frame, about 70 round trips to the JVM and an analysis per step.
    """

    def __init__(
        self,
        outputs: Mapping[str, DataFrame],
        writers: Sequence[PartitionWriter],
        measures: Mapping[str, DataFrame] | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.outputs = dict(outputs)
        self.writers = list(writers)
        self._frame = _writers_frame(outputs, writers, measures or {}, plan=self.id)
        self._afresh: bool | None = None  # whether its physical plan can run again (`run`)

    def fits(self, outputs: Mapping[str, DataFrame], writers: Sequence[PartitionWriter]) -> bool:
        """Whether the plan writes `writers` from `outputs` (the very frames it was built on)."""
        return (
            outputs.keys() == self.outputs.keys()
            and all(outputs[name] is df for name, df in self.outputs.items())
            and len(writers) == len(self.writers)
            and all(a.same_plan(b) for a, b in zip(self.writers, writers, strict=True))
        )

    def params(self, writers: Sequence[PartitionWriter]) -> dict[str, Any]:
        """The window parameter (under WRITERS_PARAM) that gives the tasks `writers`' values."""
        groups = _by_output(writers).values()
        return {"plan": self.id, "values": [w.window_values() for g in groups for w in g]}

    def run(self, writers: Sequence[PartitionWriter], *, cache_kept: bool = False) -> WriteResults:
        """Run the job for `writers` (inside `_window_params.bound` with `params(writers)`).

        `cache_kept`: the cache entries the plan reads are the ones it was first run with
        (their rows cached again for this window), so Spark's plan of the first run holds,
        unless it keeps results of its first execution (a shuffle, a broadcast: see
        `_plan_reruns`): then it is planned again too."""
        frame = self._frame
        if frame is not None and not (cache_kept and self._reruns_afresh(frame)):
            frame = frame.alias("writers")
        return _collect(frame, writers)

    def _reruns_afresh(self, frame: DataFrame) -> bool:
        if self._afresh is None:
            self._afresh = reruns_afresh(frame)
        return self._afresh


def _by_output(writers: Sequence[PartitionWriter]) -> dict[str, list[PartitionWriter]]:
    """`writers` by output, outputs in order of first appearance: the order the writers'
    function takes them in."""
    by_output: dict[str, list[PartitionWriter]] = {}
    for writer in writers:
        by_output.setdefault(writer.output, []).append(writer)
    return by_output


def rows_written(results: Sequence[Mapping[str, Any]]) -> int:
    """The rows a writer wrote over all partitions."""
    return sum(int(r.get("rows", 0)) for r in results)


class ParquetFileWriter(PartitionWriter):
    """Writes each partition of an output as one Parquet file in `<table>/<folder>/`.

    The file is written by the executor with pyarrow (local or S3) and reported back (path
    relative to `table`, size, rows), so the driver never lists the folder: a Delta table's
    files are visible to readers only once the driver commits them, a stage's once its marker
    names them.
    """

    window_fields = ("folder",)

    def __init__(
        self, key: str, output: str, table: Location, folder: str, schema: pa.Schema
    ) -> None:
        self.key = key
        self.output = output
        self.table = table
        self.folder = folder
        # Every file says every column may be null, whatever frame wrote it, so a window's
        # files and a repair's read back with one schema.
        self.schema = pa.schema([f.with_nullable(True) for f in schema])

    def columns(self, available: Sequence[str]) -> Sequence[str]:
        return self.schema.names

    def open(self, partition: int) -> PartitionHandle:
        return _FileHandle(self, partition)


class _FileHandle(PartitionHandle):
    def __init__(self, writer: ParquetFileWriter, partition: int) -> None:
        self.writer = writer
        name = f"part-{partition:05d}-{uuid.uuid4().hex}.parquet"
        self.name = f"{writer.folder}/{name}" if writer.folder else name
        self.file: pq.ParquetWriter | None = None
        self.stream: Any = None
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        w = self.writer
        if self.file is None:
            full = w.table / self.name
            (w.table / w.folder).mkdir()
            self.stream = full.filesystem().open_output_stream(full.fs_path)
            self.file = pq.ParquetWriter(self.stream, w.schema, compression="snappy")
        self.file.write_table(pa.Table.from_batches([batch]).select(w.schema.names).cast(w.schema))
        self.rows += batch.num_rows

    def close(self) -> dict[str, Any]:
        if self.file is None:
            return {"rows": 0}
        self.file.close()
        size = self.stream.tell()
        # On S3 the object exists only once the stream closes (its last PUT succeeded).
        self.stream.close()
        return {
            "rows": self.rows,
            "path": self.name,
            "size": size,
            "modified_ms": int(time.time() * 1000),
        }


def spark_schema_to_arrow(df: DataFrame) -> pa.Schema:
    """The Arrow schema the executors write `df`'s rows with (timestamps in UTC)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema, timezone="UTC")
