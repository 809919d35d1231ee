"""A window's outputs, computed once and kept until every sink holds them (stable output)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_COMPLETE = "_COMPLETE.json"


class WindowStage:
    """The staging folder of one window: `<lake>/_onceflow/staging/<job>/w<id>/<output>/`."""

    def __init__(self, lake: Path, job: str, window_id: int, tag: str = "") -> None:
        self.root = lake / "_onceflow" / "staging" / job / f"w{window_id:010d}{tag}"

    def complete(self) -> dict[str, Any] | None:
        """The stats written when staging finished, or None if it did not."""
        marker = self.root / _COMPLETE
        return json.loads(marker.read_text()) if marker.is_file() else None

    def write(self, name: str, df: DataFrame) -> DataFrame:
        """Write `df` on the executors and return a DataFrame reading the staged copy."""
        path = self.root / name
        df.write.mode("overwrite").parquet(str(path))
        return df.sparkSession.read.parquet(str(path))

    def read(self, spark: SparkSession, name: str) -> DataFrame:
        return spark.read.parquet(str(self.root / name))

    def rows(self, name: str) -> int:
        """Row count of a staged output, from the Parquet footers only."""
        return sum(pq.read_metadata(f).num_rows for f in (self.root / name).glob("*.parquet"))

    def finish(self, stats: dict[str, Any]) -> None:
        tmp = self.root / f".{_COMPLETE}.tmp"
        tmp.write_text(json.dumps(stats))
        tmp.replace(self.root / _COMPLETE)

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Contributions:
    """What each window added to an accumulating sink, kept so a restatement can take it back.

    Small (one row per key per window) and written before the sink commits, from the same
    staged rows the sink commits, so it always matches what the sink received.
    """

    def __init__(self, lake: Path, job: str, sink: str) -> None:
        self.root = lake / "_onceflow" / "contributions" / job / sink

    def path(self, window_id: int) -> Path:
        return self.root / f"w{window_id:010d}"

    def exists(self, window_id: int) -> bool:
        return self.path(window_id).is_dir()

    def save(self, window_id: int, staged: Path, *, replace: bool = False) -> None:
        """Keep a copy of `staged` as the window's contribution (atomically, by rename)."""
        if self.exists(window_id) and not replace:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".w{window_id:010d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(staged, tmp)
        if self.exists(window_id):
            old = self.root / f".w{window_id:010d}.old"
            shutil.rmtree(old, ignore_errors=True)
            self.path(window_id).rename(old)
            tmp.rename(self.path(window_id))
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(self.path(window_id))

    def read(self, spark: SparkSession, window_id: int) -> DataFrame:
        return spark.read.parquet(str(self.path(window_id)))
