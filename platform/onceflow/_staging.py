"""A window's outputs, computed once and kept until every sink holds them (stable output).

A stage is tied to the exact offsets it was computed from: its folder name carries a digest of
them, so a window re-planned over other input (after the ledger was lost) never reuses it.

The stage's files are written by the executors through pyarrow (a local lake or S3) and named
in its completion marker, written last: a stage is read from the files its marker names, never
from a listing, which an object store may show late or partly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_COMPLETE = "_COMPLETE.json"
_FILES = "_staged_files"
_SCHEMAS = "_staged_schemas"


def spill(df: DataFrame, location: Location) -> DataFrame:
    """Write `df` under `location` on the executors and return a frame that reads that copy
    (so what follows reads fixed rows, not a recomputation)."""
    from onceflow._delta_read import read_parquet_files
    from onceflow.sinks.writers import ParquetFileWriter, run_writers, spark_schema_to_arrow

    if location.is_local:
        df.write.mode("overwrite").parquet(location.uri)
        return df.sparkSession.read.schema(df.schema).parquet(location.uri)
    writer = ParquetFileWriter("spill", "df", location, "", spark_schema_to_arrow(df))
    results = run_writers({"df": df}, [writer]).written["spill"]
    uris = [(location / r["path"]).uri for r in results if r.get("rows")]
    if not uris:
        return df.sparkSession.createDataFrame([], df.schema)
    return read_parquet_files(df.sparkSession, location, uris, df.schema)


def offsets_digest(offsets: Mapping[str, Any]) -> str:
    """A short digest of a window's offsets."""
    return hashlib.sha1(json.dumps(offsets, sort_keys=True).encode()).hexdigest()[:12]


class WindowStage:
    """The staging folder of one window: `<lake>/_onceflow/staging/<job>/w<id>-<digest><tag>/`."""

    def __init__(
        self,
        lake: Location | str,
        job: str,
        window_id: int,
        offsets: Mapping[str, Any],
        tag: str = "",
    ) -> None:
        lake = lake if isinstance(lake, Location) else Location.parse(str(lake))
        self.parent = lake / "_onceflow" / "staging" / job
        self.root = self.parent / f"w{window_id:010d}-{offsets_digest(offsets)}{tag}"
        self.window_id = window_id
        self._files: dict[str, list[str]] = {}
        self._schemas: dict[str, str] = {}

    def complete(self) -> dict[str, Any] | None:
        """The stats written when staging finished, or None if it did not."""
        marker = self.root / _COMPLETE
        try:
            stats = json.loads(marker.read_bytes())
        except FileNotFoundError:
            return None
        self._files = stats.pop(_FILES, {})
        self._schemas = stats.pop(_SCHEMAS, {})
        return stats

    def intact(self, stats: Mapping[str, Any], names: Sequence[str]) -> bool:
        """True when every output is there with the row count recorded when it was staged (a
        stage with a lost or truncated file is recomputed, never reused)."""
        if self.complete() is None:  # the files it names, as the marker has them now
            return False
        counts = stats.get("outputs", {})
        for name in names:
            if name not in counts or name not in self._files or name not in self._schemas:
                return False
            try:
                if self.rows(name) != counts[name]:
                    return False
            except (OSError, pa.ArrowException):
                return False
        return True

    def clear(self) -> None:
        """Remove this stage only."""
        self.root.delete_tree()

    def path(self, name: str) -> Location:
        """Where an output's files are."""
        return self.root / name

    def write(self, name: str, df: DataFrame) -> DataFrame:
        """Write `df` on the executors and return a DataFrame reading the staged copy."""
        from onceflow.sinks.writers import ParquetFileWriter, run_writers, spark_schema_to_arrow

        writer = ParquetFileWriter(name, name, self.root, name, spark_schema_to_arrow(df))
        results = run_writers({name: df}, [writer]).written[name]
        self._files[name] = sorted(r["path"] for r in results if r.get("rows"))
        self._schemas[name] = df.schema.json()
        return self._read(df.sparkSession, name, df.schema)

    def read(self, spark: SparkSession, name: str) -> DataFrame:
        """A staged output, from the files the marker names (after `complete()`)."""
        from pyspark.sql.types import StructType

        return self._read(spark, name, StructType.fromJson(json.loads(self._schemas[name])))

    def _read(self, spark: SparkSession, name: str, schema: Any) -> DataFrame:
        from onceflow._delta_read import read_parquet_files

        uris = [(self.root / f).uri for f in self._files.get(name, [])]
        if not uris:
            return spark.createDataFrame([], schema)
        if self.root.is_local:
            return spark.read.schema(schema).parquet(*uris)
        return read_parquet_files(spark, self.root, uris, schema)

    def rows(self, name: str) -> int:
        """Row count of a staged output, from the Parquet footers only."""
        fs = self.root.filesystem()
        total = 0
        for rel in self._files.get(name, []):
            with fs.open_input_file((self.root / rel).fs_path) as handle:
                total += pq.read_metadata(handle).num_rows
        return total

    def finish(self, stats: dict[str, Any]) -> None:
        marker = {**stats, _FILES: self._files, _SCHEMAS: self._schemas}
        (self.root / _COMPLETE).write_bytes(json.dumps(marker).encode())

    def discard(self) -> None:
        """Remove this window's stages (any digest or tag)."""
        for folder in self.parent.children(f"w{self.window_id:010d}-"):
            (self.parent / folder).delete_tree()
