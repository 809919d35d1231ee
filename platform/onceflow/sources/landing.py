"""A landing folder of line-oriented files; a window's offset is its exact list of files."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.errors import ConfigurationError, SourceError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Columns of the raw-line DataFrame every landing read gives: the position of each line and its
# bytes, undecoded, so that invalid UTF-8 reaches validation instead of failing the read.
RAW_SCHEMA = "_file_idx INT, _source_file STRING, _source_line BIGINT, _raw BINARY"


@dataclass(frozen=True)
class LandingSource:
    """Files under `<landing root>/<folder>` matching `suffix`, taken in discovery order.

    A visible file is complete and never changes: producers write under a temporary name and
    rename. Names starting with `.` or `_`, or ending in `.tmp`, are not input.
    """

    folder: str
    suffix: str = ".jsonl"

    def discover(self, root: Path) -> list[str]:
        """Visible input files, as paths relative to `root`, in name order."""
        base = root / self.folder
        if not base.is_dir():
            return []
        names = sorted(
            entry.name
            for entry in base.iterdir()
            if entry.is_file()
            and entry.name.endswith(self.suffix)
            and not entry.name.startswith((".", "_"))
            and not entry.name.endswith(".tmp")
        )
        return [f"{self.folder}/{name}" for name in names]

    def offsets(self, root: Path, files: Sequence[str]) -> dict[str, Any]:
        """The window offsets for `files`: their exact list, in source order, with sizes."""
        ordered = sorted(files)
        return {"files": ordered, "sizes": [(root / f).stat().st_size for f in ordered]}

    def check_available(self, root: Path, offsets: dict[str, Any]) -> list[str]:
        """Files of a window that are gone or changed (empty when the window can be replayed)."""
        problems = []
        for path, size in zip(offsets["files"], offsets.get("sizes", []), strict=False):
            full = root / path
            if not full.is_file():
                problems.append(f"{path}: missing")
            elif full.stat().st_size != size:
                problems.append(f"{path}: size {full.stat().st_size}, expected {size}")
        return problems

    def read(self, spark: SparkSession, root: Path, offsets: dict[str, Any]) -> DataFrame:
        """The window's lines as a DataFrame with RAW_SCHEMA, read on the executors."""
        problems = self.check_available(root, offsets)
        if problems:
            raise SourceError(
                "window input is no longer what was planned: "
                + "; ".join(problems[:5])
                + ". Restore the files, or reconcile to report the window as unverifiable."
            )
        _register(spark)
        return (
            spark.read.format(_LinesDataSource.name())
            .option("root", str(root))
            .option("files", json.dumps(list(offsets["files"])))
            .load()
        )


def check_root(root: Path) -> None:
    if not root.is_dir():
        raise ConfigurationError(
            f"landing folder {root} does not exist; create it or set ONCEFLOW_LANDING."
        )


_registered: set[int] = set()


def _register(spark: SparkSession) -> None:
    key = id(spark)
    if key not in _registered:
        spark.dataSource.register(_LinesDataSource)
        _registered.add(key)


def _iter_lines(root: str, file_idx: int, rel: str) -> Iterator[tuple[int, str, int, bytes]]:
    with open(Path(root) / rel, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield (file_idx, rel, number, line.rstrip(b"\n"))


class _FilePartition(InputPartition):
    def __init__(self, index: int, path: str) -> None:
        super().__init__(index)
        self.index = index
        self.path = path


class _LinesReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.root = options["root"]
        self.files: list[str] = json.loads(options["files"])

    def partitions(self) -> list[InputPartition]:
        return [_FilePartition(i, path) for i, path in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[tuple[int, str, int, bytes]]:
        assert isinstance(partition, _FilePartition)
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
