"""Landing folders: files that appear over time; a window's offsets are its exact list of files.

A visible file is complete and never changes: producers write under a temporary name and
rename. Names starting with `.` or `_`, or ending in `.tmp`, are not input. Files enter windows
in the order they are discovered, and files discovered together in name order.
"""

from __future__ import annotations

import json
import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.errors import SourceError
from onceflow.sources.base import BatchFunction, Observation, Source

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

    def base(self, settings: Settings) -> Path:
        return settings.landing / self.folder

    def discover(self, settings: Settings, after: Mapping[str, Any] | None = None) -> list[str]:
        """Visible input files, as paths relative to the landing root, in name order."""
        base = self.base(settings)
        if not base.is_dir():
            return []
        names = sorted(
            entry.name
            for entry in base.iterdir()
            if entry.name.endswith(self.suffix)
            and not entry.name.startswith((".", "_"))
            and not entry.name.endswith(".tmp")
            and entry.is_file()
        )
        return [f"{self.folder}/{name}" for name in names]

    def offsets(self, settings: Settings, units: Sequence[str]) -> dict[str, Any]:
        """The files in name order, with their sizes (a changed file is detected on replay)."""
        ordered = sorted(units)
        return {
            "files": ordered,
            "sizes": [(settings.landing / f).stat().st_size for f in ordered],
        }

    def units(self, offsets: Mapping[str, Any]) -> list[str]:
        return list(offsets.get("files", []))

    def check_available(self, settings: Settings, offsets: Mapping[str, Any]) -> list[str]:
        problems = []
        sizes = list(offsets.get("sizes", []))
        for i, path in enumerate(offsets.get("files", [])):
            full = settings.landing / path
            if not full.is_file():
                problems.append(f"{path}: missing")
            elif i < len(sizes) and full.stat().st_size != sizes[i]:
                problems.append(f"{path}: size {full.stat().st_size}, expected {sizes[i]}")
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
    def read_files(self, spark: SparkSession, root: Path, files: list[str]) -> DataFrame:
        """The records of `files` (relative to `root`), one Spark partition per file."""

    def observe(self, settings: Settings) -> Observation:
        """The newest file's name and modification time, and the file count: a file that
        lands, or lands again with new contents, changes the version."""
        files = self.discover(settings, None)
        newest = files[-1] if files else ""
        try:
            mtime = (settings.landing / newest).stat().st_mtime_ns if newest else 0
        except OSError:
            mtime = 0
        return Observation(
            version=f"{len(files)}:{newest}:{mtime}",
            units=len(files),
            metadata={"files": len(files), "newest_file": newest or "none"},
        )

    def unit_age_s(self, settings: Settings, unit: str) -> float | None:
        try:
            return max(0.0, time.time() - (settings.landing / unit).stat().st_mtime)
        except OSError:
            return None

    def unit_size(self, settings: Settings, unit: str) -> int | None:
        try:
            return (settings.landing / unit).stat().st_size
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
        if not files or not all(_binary_readable(settings.landing / f) for f in files):
            return super().read_mapped(spark, settings, offsets, fn, schema)
        _check_planned(self.check_available(settings, offsets))
        return _read_binary(spark, settings.landing, files, then=fn, schema=schema)

    def read_files(self, spark: SparkSession, root: Path, files: list[str]) -> DataFrame:
        if files and all(_binary_readable(root / f) for f in files):
            return _read_binary(spark, root, files)
        # Registered on every read: a Spark Connect session can change under us.
        spark.dataSource.register(_LinesDataSource)
        return (
            spark.read.format(_LinesDataSource.name())
            .option("root", str(root))
            .option("files", json.dumps(files))
            .load()
        )


# Files Spark's own binary reader takes (it reads a whole file as one value): smaller than
# this, and with names that Hadoop paths neither glob nor misparse.
BINARY_READ_MAX_BYTES = 256 << 20
# Windows up to this size are read as one Spark partition.
ONE_TASK_MAX_BYTES = 16 << 20
_HADOOP_UNSAFE = frozenset(":*?[]{}\\#%")


def _binary_readable(path: Path) -> bool:
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return size < BINARY_READ_MAX_BYTES and not _HADOOP_UNSAFE.intersection(str(path))


def _check_planned(problems: list[str]) -> None:
    if problems:
        raise SourceError(
            "window input is no longer what was planned: "
            + "; ".join(problems[:5])
            + ". Restore the files, or reconcile to report the window as unverifiable."
        )


def _read_binary(
    spark: SparkSession,
    root: Path,
    files: list[str],
    *,
    then: BatchFunction | None = None,
    schema: str = "",
) -> DataFrame:
    """The lines of `files`, read by Spark's native binary-file reader and split on the
    executors, then passed through `then` (output `schema`) in the same Python step."""
    full = [str((root / rel).absolute()) for rel in files]
    index = {path: (i, rel) for i, (path, rel) in enumerate(zip(full, files, strict=True))}

    def split(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from urllib.parse import unquote, urlparse

        import pyarrow as pa

        for batch in batches:
            for uri, content in zip(
                batch.column("path").to_pylist(), batch.column("content").to_pylist(), strict=True
            ):
                path = unquote(urlparse(uri).path)
                found = index.get(path) or next(
                    (v for k, v in index.items() if path.endswith("/" + v[1])), None
                )
                if found is None:
                    raise SourceError(f"the binary reader returned a file not asked for: {uri}")
                file_idx, rel = found
                lines = content.split(b"\n")
                if lines[-1] == b"":  # the newline that ends the last line starts no new one
                    lines.pop()
                if lines:
                    yield pa.RecordBatch.from_pydict(
                        {
                            "_file_idx": pa.array([file_idx] * len(lines), pa.int32()),
                            "_source_file": [rel] * len(lines),
                            "_source_line": pa.array(range(1, len(lines) + 1), pa.int64()),
                            "_raw": pa.array(lines, pa.binary()),
                        }
                    )

    def split_then(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        assert then is not None
        return then(split(batches))

    files_frame = spark.read.format("binaryFile").load(full).select("path", "content")
    if sum((root / rel).stat().st_size for rel in files) <= ONE_TASK_MAX_BYTES:
        # A small window is read, parsed and deduplicated by one task: no shuffle to find
        # first occurrences, and one file per output.
        files_frame = files_frame.coalesce(1)
    if then is None:
        return files_frame.mapInArrow(split, RAW_SCHEMA)
    return files_frame.mapInArrow(split_then, schema)


def _iter_lines(root: str, file_idx: int, rel: str) -> Iterator[tuple[int, str, int, bytes]]:
    with open(Path(root) / rel, "rb") as handle:
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
