"""A window's outputs, computed once and kept until every sink holds them (stable output).

A stage is tied to the exact offsets it was computed from: its folder name carries a digest of
them, so a window re-planned over other input (after the ledger was lost) never reuses it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_COMPLETE = "_COMPLETE.json"


def offsets_digest(offsets: Mapping[str, Any]) -> str:
    """A short digest of a window's offsets."""
    return hashlib.sha1(json.dumps(offsets, sort_keys=True).encode()).hexdigest()[:12]


class WindowStage:
    """The staging folder of one window: `<lake>/_onceflow/staging/<job>/w<id>-<digest><tag>/`."""

    def __init__(
        self, lake: Path, job: str, window_id: int, offsets: Mapping[str, Any], tag: str = ""
    ) -> None:
        self.parent = lake / "_onceflow" / "staging" / job
        self.root = self.parent / f"w{window_id:010d}-{offsets_digest(offsets)}{tag}"
        self.window_id = window_id

    def complete(self) -> dict[str, Any] | None:
        """The stats written when staging finished, or None if it did not."""
        marker = self.root / _COMPLETE
        return json.loads(marker.read_text()) if marker.is_file() else None

    def intact(self, stats: Mapping[str, Any], names: Sequence[str]) -> bool:
        """True when every output is there with the row count recorded when it was staged (a
        stage with a lost or truncated file is recomputed, never reused)."""
        counts = stats.get("outputs", {})
        for name in names:
            folder = self.root / name
            if name not in counts or not folder.is_dir():
                return False
            try:
                if self.rows(name) != counts[name]:
                    return False
            except (OSError, pa.ArrowException):
                return False
        return True

    def clear(self) -> None:
        """Remove this stage only."""
        shutil.rmtree(self.root, ignore_errors=True)

    def path(self, name: str) -> Path:
        return self.root / name

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
        """Remove this window's stages (any digest or tag)."""
        if not self.parent.is_dir():
            return
        for folder in self.parent.glob(f"w{self.window_id:010d}-*"):
            shutil.rmtree(folder, ignore_errors=True)
