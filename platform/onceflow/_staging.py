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

    def __init__(self, lake: Path, job: str, window_id: int) -> None:
        self.root = lake / "_onceflow" / "staging" / job / f"w{window_id:010d}"

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
