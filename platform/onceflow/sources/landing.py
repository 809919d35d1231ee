"""Landing folders: files that appear over time; a window's offsets are its exact list of files.

A visible file is complete and never changes: producers write under a temporary name and
rename (on S3, one PUT per file: an object is visible whole or not at all). Names starting with
`.` or `_`, or ending in `.tmp`, are not input. Files enter windows in the order they are
discovered, and files discovered together in name order. A window's offsets record each
file's size and modification time, so a file changed after its window committed (input the
job never reads again) is reported (`changed_after_commit`) rather than passed over in silence.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow import _window_params as window_params
from onceflow.errors import ConfigurationError, SourceError
from onceflow.sources.base import BatchFunction, ChangedUnit, Observation, Source
from onceflow.storage import Location, open_input

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.settings import Settings


@dataclass(frozen=True)
class LandingFiles(Source):
    """Files under `<landing root>/<folder>` whose names end in `suffix`.

    Subclasses say how a file becomes records (`read_files`).
    """

    folder: str
    suffix: str

    kind = "landing"

    def describe(self) -> str:
        return f"landing files `{self.folder}/*{self.suffix}`"

    def base(self, settings: Settings) -> Location:
        return settings.landing / self.folder

    def location(self, settings: Settings) -> str | None:
        return self.base(settings).uri

    def check_input(self, settings: Settings) -> None:
        base = self.base(settings)
        # An object store has no folders: an empty prefix is an empty folder.
        if not base.is_local or base.is_dir():
            return
        raise ConfigurationError(
            f"the source folder {base} does not exist (folder {self.folder!r} under "
            f"ONCEFLOW_LANDING={settings.landing}); create it (an empty folder is fine: "
            f"`mkdir -p {base}`) or set ONCEFLOW_LANDING to the folder that holds {self.folder!r}."
        )

    def changed_after_commit(
        self, settings: Settings, windows: Mapping[int, Mapping[str, Any]]
    ) -> list[ChangedUnit]:
        if not windows:
            return []
        # One listing for every window: a stat per committed file would cost a round trip
        # each on an object store.
        base = self.base(settings)
        now = {f"{self.folder}/{posixpath.basename(info.path)}": info for info in base.files()}
        # An object store's listing gives modification times in milliseconds, a look at one
        # object (as planning takes them) in whole seconds: compare seconds there.
        unit = 1 if base.is_local else 1_000_000_000
        changed = []
        for window_id, offsets in sorted(windows.items()):
            sizes = list(offsets.get("sizes", []))
            mtimes = list(offsets.get("mtimes", []))
            for i, path in enumerate(offsets.get("files", [])):
                info = now.get(path)
                if info is None:
                    continue
                if i < len(sizes) and int(info.size or 0) != int(sizes[i]):
                    detail = f"now {info.size} bytes, {sizes[i]} when its window committed"
                elif i < len(mtimes) and int(info.mtime_ns or 0) // unit != int(mtimes[i]) // unit:
                    detail = "same size, modified after its window committed"
                else:
                    continue
                changed.append(ChangedUnit(window_id, path, detail))
        return changed

    def discover(self, settings: Settings, after: Mapping[str, Any] | None = None) -> list[str]:
        """Visible input files, as paths relative to the landing root, in name order."""
        names = sorted(
            name
            for name in (posixpath.basename(info.path) for info in self.base(settings).files())
            if name.endswith(self.suffix)
            and not name.startswith((".", "_"))
            and not name.endswith(".tmp")
        )
        return [f"{self.folder}/{name}" for name in names]

    def offsets(self, settings: Settings, units: Sequence[str]) -> dict[str, Any]:
        """The files in name order, with their sizes (a changed file is detected on replay)
        and modification times (nanoseconds; a file changed after its window is reported)."""
        ordered = sorted(units)
        facts = [_file_facts(settings.landing / f) for f in ordered]
        return {
            "files": ordered,
            "sizes": [size for size, _ in facts],
            "mtimes": [mtime for _, mtime in facts],
        }

    def units(self, offsets: Mapping[str, Any]) -> list[str]:
        return list(offsets.get("files", []))

    def check_available(self, settings: Settings, offsets: Mapping[str, Any]) -> list[str]:
        problems = []
        sizes = list(offsets.get("sizes", []))
        for i, path in enumerate(offsets.get("files", [])):
            try:
                size = (settings.landing / path).size()
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            if i < len(sizes) and size != sizes[i]:
                problems.append(f"{path}: size {size}, expected {sizes[i]}")
        return problems

    def read(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> DataFrame:
        _check_planned(self.check_available(settings, offsets))
        return self.read_files(spark, settings.landing, list(offsets.get("files", [])))

    def read_many(
        self, spark: SparkSession, settings: Settings, offsets: Sequence[Mapping[str, Any]]
    ) -> tuple[DataFrame, list[tuple[int, int, int]]] | None:
        files: list[str] = []
        file_map: list[tuple[int, int, int]] = []
        for position, window in enumerate(offsets):
            problems = self.check_available(settings, window)
            if problems:
                raise SourceError("window input is no longer what was planned: " + problems[0])
            for local, path in enumerate(window.get("files", [])):
                file_map.append((len(files), position, local))
                files.append(path)
        return self.read_files(spark, settings.landing, files), file_map

    @abstractmethod
    def read_files(self, spark: SparkSession, root: Location, files: list[str]) -> DataFrame:
        """The records of `files` (relative to `root`), one Spark partition per file."""

    def observe(self, settings: Settings) -> Observation:
        """The newest file's name and modification time, and the file count: a file that
        lands, or lands again with new contents, changes the version."""
        files = self.discover(settings, None)
        newest = files[-1] if files else ""
        try:
            mtime = (settings.landing / newest).mtime_ns() if newest else 0
        except OSError:
            mtime = 0
        return Observation(
            version=f"{len(files)}:{newest}:{mtime}",
            units=len(files),
            metadata={"files": len(files), "newest_file": newest or "none"},
        )

    def unit_age_s(self, settings: Settings, unit: str) -> float | None:
        try:
            return max(0.0, time.time() - (settings.landing / unit).mtime_ns() / 1e9)
        except OSError:
            return None

    def unit_size(self, settings: Settings, unit: str) -> int | None:
        try:
            return (settings.landing / unit).size()
        except OSError:
            return None


# Columns of the raw-line frame: the position of each line and its bytes, undecoded, so that
# invalid UTF-8 reaches the job's parse step instead of failing the read.
RAW_SCHEMA = "_file_idx INT, _source_file STRING, _source_line BIGINT, _raw BINARY"


@dataclass(frozen=True)
class LandingSource(LandingFiles):
    """Line-oriented landing files (JSON lines by default): one raw record per line.

    The job's `parse` turns each line's bytes (`_raw`) into typed columns plus `_reason` and
    `_raw_text`.
    """

    folder: str
    suffix: str = ".jsonl"

    def read_mapped(
        self,
        spark: SparkSession,
        settings: Settings,
        offsets: Mapping[str, Any],
        fn: BatchFunction,
        schema: str,
    ) -> DataFrame:
        files = list(offsets.get("files", []))
        sizes = _sizes(settings.landing, offsets)
        if not files or max(sizes) >= WHOLE_READ_MAX_BYTES:
            return super().read_mapped(spark, settings, offsets, fn, schema)
        _check_planned(self.check_available(settings, offsets))
        return _read_whole(spark, settings.landing, files, sizes, then=fn, schema=schema)

    def window_read(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        files = list(offsets.get("files", []))
        sizes = _sizes(settings.landing, offsets)
        if not files or not _whole_in_one_task(spark, sizes):
            return None
        _check_planned(self.check_available(settings, offsets))
        return {"files": files}

    def read_planned(
        self, spark: SparkSession, settings: Settings, fn: BatchFunction, schema: str, slot: int
    ) -> DataFrame:
        root = settings.landing

        def split_then(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for _ in batches:  # the slot's one row: it says nothing
                pass
            return fn(_split(root, window_params.current()["read"]["files"]))

        # The slot is the range's one id: plans of different slots differ, so Spark never
        # takes one slot's cached rows for the other's.
        return spark.range(slot, slot + 1, 1, 1).mapInArrow(split_then, schema)

    def reads_in_order(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> bool:
        sizes = _sizes(settings.landing, offsets)
        return bool(sizes) and _whole_in_one_task(spark, sizes)

    def reads_in_runs(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> bool:
        # Every read of a window's files gives each task its units in unit order, each unit's
        # lines in line order (`_read_whole`'s range slices, or the line reader's file a task).
        return bool(offsets.get("files"))

    def read_files(self, spark: SparkSession, root: Location, files: list[str]) -> DataFrame:
        sizes = [_size(root / f) for f in files]
        if files and max(sizes) < WHOLE_READ_MAX_BYTES:
            return _read_whole(spark, root, files, sizes)
        # Registered on every read: a Spark Connect session can change under us.
        spark.dataSource.register(_LinesDataSource)
        return (
            spark.read.format(_LinesDataSource.name())
            .option("root", root.uri)
            .option("files", json.dumps(files))
            .load()
        )


# Files read whole by the Python step that splits them: smaller than this. Larger ones are
# read line by line (`_LinesDataSource`).
WHOLE_READ_MAX_BYTES = 256 << 20
# Windows up to this size are read as one Spark partition; so are windows up to
# WHOLE_READ_MAX_BYTES when the read has one core (`_read_cores`).
ONE_TASK_MAX_BYTES = 16 << 20
# Larger windows: read units of a file each, a large file split into line-aligned byte ranges
# so that a window has a unit for each of the read's cores, none over CHUNK_MAX_BYTES (nor
# under CHUNK_MIN_BYTES). A task reads a run of consecutive units in order: a run for each core,
# or a multiple of the cores when a run would read more than RUN_MAX_BYTES, and at most
# MAX_READ_TASKS runs.
MAX_READ_TASKS = 64
RUN_MAX_BYTES = 64 << 20
CHUNK_MIN_BYTES = 4 << 20
CHUNK_MAX_BYTES = 32 << 20
# The lines before a range are counted in reads of this size.
_COUNT_BLOCK_BYTES = 8 << 20


def _file_facts(path: Location) -> tuple[int, int]:
    """The file's size and modification time (ns), from one look.

    Raises:
        FileNotFoundError: There is no file here.
    """
    import pyarrow.fs as pafs

    info = path.info()
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(path.uri)
    return int(info.size or 0), int(info.mtime_ns or 0)


def _size(path: Location) -> int:
    """The file's size; past every limit if it cannot be read (the line reader then reports
    why)."""
    try:
        return path.size()
    except OSError:
        return WHOLE_READ_MAX_BYTES


def _sizes(root: Location, offsets: Mapping[str, Any]) -> list[int]:
    """The window's file sizes as planned (checked against the files before they are read),
    or as they are for offsets planned without them."""
    files = list(offsets.get("files", []))
    sizes = list(offsets.get("sizes", []))
    if len(sizes) == len(files):
        return [int(size) for size in sizes]
    return [_size(root / f) for f in files]


def _whole_in_one_task(spark: SparkSession, sizes: list[int]) -> bool:
    """Files read whole, by one task: in file and line order. The session is asked for its
    cores (`_read_cores`) only for a window over ONE_TASK_MAX_BYTES."""
    total = sum(sizes)
    if max(sizes) >= WHOLE_READ_MAX_BYTES:
        return False
    return total <= ONE_TASK_MAX_BYTES or (total < WHOLE_READ_MAX_BYTES and _read_cores(spark) < 2)


def _check_planned(problems: list[str]) -> None:
    if problems:
        raise SourceError(
            "window input is no longer what was planned: "
            + "; ".join(problems[:5])
            + ". Restore the files, or reconcile to report the window as unverifiable."
        )


def _read_whole(
    spark: SparkSession,
    root: Location,
    files: list[str],
    sizes: list[int],
    *,
    then: BatchFunction | None = None,
    schema: str = "",
) -> DataFrame:
    """The lines of `files`, read and split by the Python step that then passes them through
    `then` (output `schema`): a small window by one task, a larger one in read units (a file,
    or a large file's byte range: `_read_units`), a run of consecutive units a task
    (`_read_runs`), so that every core of the read (`_read_cores`) has a share.

    The step's input is `spark.range` over the read units' positions, the names travelling in
    the step's closure: two DataFrame operations to plan, where Spark's binary-file reader lists
    the files on the driver and copies their bytes through the JVM. A local folder and an
    object store are read alike (Spark's Hadoop filesystem has no S3 here).
    """

    if _whole_in_one_task(spark, sizes):
        units: list[Unit] = [(i, 0, None) for i in range(len(files))]
        tasks = 1
    else:
        cores = _read_cores(spark)
        units = _read_units(sizes, cores)
        tasks = _read_runs(len(units), sum(sizes), cores)

    def split(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield from _split_units(root, files, [units[u] for u in batch.column("id").to_pylist()])

    def split_then(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        assert then is not None
        return then(split(batches))

    # A small window is read, parsed and deduplicated by one task, in file and line order: no
    # shuffle or sort to find first occurrences, and one file per output. A larger one by a
    # run of consecutive units a task (Spark slices a range into consecutive ids), in order.
    positions = spark.range(0, len(units), 1, tasks)
    if then is None:
        return positions.mapInArrow(split, RAW_SCHEMA)
    return positions.mapInArrow(split_then, schema)


def _read_runs(units: int, total: int, cores: int) -> int:
    """How many tasks read a window's `units` (of `total` bytes), each a run of consecutive
    units: one a core, a multiple of the cores when a run would be larger than RUN_MAX_BYTES
    (so no core waits on a last, lone run), never more than the units or MAX_READ_TASKS.

    Few runs, not a task a unit: each task's rows pass the key lookup in source order, which
    finds a key's repeats within the run on the way; only keys kept by several runs are
    compared across them (`_compute`), and a task costs the writers a file and a COPY each."""
    cores = max(1, cores)
    rounds = max(1, -(-total // (cores * RUN_MAX_BYTES)))
    return max(1, min(units, cores * rounds, MAX_READ_TASKS))


# What one task of a window's read reads: a file's position among the window's files, and the
# byte range [start, end) where its lines start (end None: the whole file).
Unit = tuple[int, int, int | None]


def _read_cores(spark: SparkSession) -> int:
    """The cores a window's read is spread over: half the session's (`_parallelism`).

    A run keeps two windows in flight, the next one read and computed while the one before it
    is written and committed (the writers' tasks, the driver's commit, the sinks' servers). On
    2 cores a window read by one task, planned once and deduplicated as it passes, was faster
    at every size than the same window read by a run of files a core (0.80-0.93x the peer
    against 0.90-1.26x at 100,000 to 1,000,000 rows a window, docs/benchmarks.md): the other
    core was never idle. With 4 cores and more, a large window is read in runs."""
    return max(1, _parallelism(spark) // 2)


def _parallelism(spark: SparkSession) -> int:
    """The session's cores as Spark counts them (`spark.default.parallelism`, else its
    executors' cores), else this machine's."""
    try:
        configured = int(spark.conf.get("spark.default.parallelism", "0") or 0)
    except (ValueError, TypeError):
        configured = 0
    if configured > 0:
        return configured
    if window_params.supported(spark):  # a session with a SparkContext: a cluster's count
        return max(1, spark.sparkContext.defaultParallelism)
    return max(1, os.cpu_count() or 1)


def _read_units(sizes: Sequence[int], cores: int) -> list[Unit]:
    """A window's files as read units: a file a unit, a file larger than the chunk in
    line-aligned byte ranges of about the chunk's size. The chunk is the window's bytes over
    its cores, within CHUNK_MIN_BYTES and CHUNK_MAX_BYTES, and large enough that the window
    needs no more than MAX_READ_TASKS units of its larger files."""
    total = sum(sizes)
    chunk = max(
        CHUNK_MIN_BYTES,
        min(CHUNK_MAX_BYTES, -(-total // max(1, cores))),
        -(-total // MAX_READ_TASKS),
    )
    units: list[Unit] = []
    for file_idx, size in enumerate(sizes):
        parts = max(1, -(-size // chunk))
        if parts == 1:
            units.append((file_idx, 0, None))
            continue
        step = -(-size // parts)
        units.extend((file_idx, k * step, min(size, (k + 1) * step)) for k in range(parts))
    return units


def _split_units(
    root: Location, files: Sequence[str], units: Sequence[Unit]
) -> Iterator[pa.RecordBatch]:
    """The lines of each unit, as raw-line batches (one a unit)."""
    for file_idx, start, end in units:
        rel = files[file_idx]
        if end is None:
            lines = _lines_batch(file_idx, rel, (root / rel).read_bytes())
        else:
            lines = _range_batch(root / rel, file_idx, rel, start, end)
        if lines is not None:
            yield lines


def _range_batch(
    path: Location, file_idx: int, rel: str, start: int, end: int
) -> pa.RecordBatch | None:
    """The lines of one file that start in the byte range [start, end), at their positions in
    the file (None if no line starts there).

    The lines before the range are counted block by block, not kept: a task holds its range
    and the end of the line that crosses `end`, never the file up to it."""
    head = max(0, start - 1)  # the byte before `start` says whether a line starts at `start`
    first = 1
    with path.filesystem().open_input_file(path.fs_path) as handle:
        size = handle.size()
        for at in range(0, head, _COUNT_BLOCK_BYTES):
            first += bytes(handle.read_at(min(_COUNT_BLOCK_BYTES, head - at), at)).count(b"\n")
        content = bytes(handle.read_at(min(end, size) - head, head))
        at = head + len(content)
        while at < size and not content.endswith(b"\n"):
            block = bytes(handle.read_at(min(1 << 20, size - at), at))
            cut = block.find(b"\n")
            content += block if cut < 0 else block[: cut + 1]
            at += len(block)
            if cut >= 0:
                break
    begin = 0 if start == 0 else content.find(b"\n") + 1
    if (begin == 0 and start > 0) or begin >= len(content):
        return None
    first += content.count(b"\n", 0, begin)
    return _lines_batch(file_idx, rel, content[begin:], first)


def _split(root: Location, files: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The lines of `files`, in file and line order, as raw-line batches (one a file)."""
    return _split_units(root, files, [(i, 0, None) for i in range(len(files))])


def _lines_batch(file_idx: int, rel: str, content: bytes, first: int = 1) -> pa.RecordBatch | None:
    """The lines of `content` (a file's, or its lines from line `first` on) as a raw-line batch
    (None for no line)."""
    import pyarrow as pa

    lines = content.split(b"\n")
    if lines[-1] == b"":  # the newline that ends the last line starts no new one
        lines.pop()
    if not lines:
        return None
    return pa.RecordBatch.from_pydict(
        {
            "_file_idx": pa.array([file_idx] * len(lines), pa.int32()),
            "_source_file": [rel] * len(lines),
            "_source_line": pa.array(range(first, first + len(lines)), pa.int64()),
            "_raw": pa.array(lines, pa.binary()),
        }
    )


def _iter_lines(root: str, file_idx: int, rel: str) -> Iterator[tuple[int, str, int, bytes]]:
    with open_input(root, rel) as handle:
        for number, line in enumerate(handle, start=1):
            yield (file_idx, rel, number, line.rstrip(b"\n"))


class FilePartition(InputPartition):
    """One landing file, read by one Spark task."""

    def __init__(self, index: int, path: str) -> None:
        super().__init__(index)
        self.index = index
        self.path = path


class _LinesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.root = options["root"]
        self.files: list[str] = json.loads(options["files"])

    def partitions(self) -> list[InputPartition]:
        return [FilePartition(i, path) for i, path in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[tuple[int, str, int, bytes]]:
        # With no files Spark still runs one task, with a plain InputPartition: no rows.
        if isinstance(partition, FilePartition):
            yield from _iter_lines(self.root, partition.index, partition.path)


class _LinesDataSource(DataSource):
    """Spark data source `onceflow_lines`: one partition per file, one row per line."""

    @classmethod
    def name(cls) -> str:
        return "onceflow_lines"

    def schema(self) -> str:
        return RAW_SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return _LinesReader(dict(self.options))
