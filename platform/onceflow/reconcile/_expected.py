"""The expected outputs of a job, replayed from the ledger's windows without reading any sink."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING

from onceflow.job import Job, WindowContext
from onceflow.ledger import Window

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Every expected output carries the window that produced each row in this column.
WINDOW_COL = "__onceflow_window"
_ORDER_COL = "__onceflow_order"


def expected_outputs(
    spark: SparkSession,
    job: Job,
    landing: Path,
    windows: Sequence[Window],
    workdir: Path,
    *,
    seen: DataFrame | None = None,
) -> dict[str, DataFrame]:
    """Recompute every output of `job` for `windows`, as one sequence, on Spark.

    Unlike `Engine.compute`, which dedupes one window against the rows the Delta state sink
    holds (and so inherits its damage), this reads every window's input in window order and
    keeps the first valid occurrence of each dedupe key over the whole sequence (window, file,
    line), then applies the transform to each window's kept rows. Intermediate results are
    written under `workdir`, so the input is read and parsed once.

    Args:
        spark: The Spark session.
        job: The job.
        landing: The landing root.
        windows: The windows to replay, all with their input available.
        workdir: An empty folder for intermediate Parquet files.
        seen: Dedupe key columns plus WINDOW_COL: keys whose first occurrence is in a window
            that cannot be replayed; their occurrences in later windows are duplicates.

    Returns:
        Each output by name, with WINDOW_COL added; outputs no window produced are absent.
    """
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    windows = sorted(windows, key=lambda w: w.window_id)
    files: list[str] = []
    sizes: list[int] = []
    file_map: list[tuple[int, int, int]] = []
    for window in windows:
        window_files = list(window.offsets.get("files", []))
        window_sizes = list(window.offsets.get("sizes", []))
        for local, path in enumerate(window_files):
            file_map.append((len(files), local, window.window_id))
            files.append(path)
            sizes.append(window_sizes[local] if local < len(window_sizes) else -1)
    if not files:
        return {}
    offsets = {"files": files}
    if all(s >= 0 for s in sizes):
        offsets["sizes"] = sizes  # type: ignore[assignment]
    # One read of every window's files: `_file_idx` becomes the file's position in the whole
    # sequence, which orders occurrences across windows; the file map restores the window id
    # and the file's index within its window.
    raw = job.source.read(spark, landing, offsets)
    positions = spark.createDataFrame(
        file_map, f"{_ORDER_COL} INT, __local_idx INT, {WINDOW_COL} BIGINT"
    )
    parsed = (
        job.parse(raw)
        .withColumnRenamed("_file_idx", _ORDER_COL)
        .join(F.broadcast(positions), _ORDER_COL)
        .withColumnRenamed("__local_idx", "_file_idx")
    )
    parsed = _materialise(parsed, workdir / "parsed")
    valid = parsed.where(F.col("_reason").isNull())
    invalid = parsed.where(F.col("_reason").isNotNull())
    if job.dedupe is not None:
        keys = list(job.dedupe.key)
        if seen is not None:
            first_seen = seen.groupBy(*keys).agg(F.min(WINDOW_COL).alias("__seen_in"))
            valid = (
                valid.join(first_seen, keys, "left")
                .where(F.col("__seen_in").isNull() | (F.col(WINDOW_COL) < F.col("__seen_in")))
                .drop("__seen_in")
            )
        first = W.partitionBy(*keys).orderBy(_ORDER_COL, "_source_line")
        valid = (
            valid.withColumn("__occurrence", F.row_number().over(first))
            .where(F.col("__occurrence") == 1)
            .drop("__occurrence")
        )
    kept = _materialise(valid, workdir / "kept")
    parts: dict[str, list[DataFrame]] = {}
    for window in windows:
        wid = window.window_id
        rows = kept.where(F.col(WINDOW_COL) == wid).drop(WINDOW_COL, _ORDER_COL)
        for name, df in job.transform(rows, WindowContext(job.name, wid)).items():
            parts.setdefault(name, []).append(df.withColumn(WINDOW_COL, F.lit(wid).cast("bigint")))
    if job.quarantine_sink is not None:
        parts.setdefault(job.sink(job.quarantine_sink).output, []).append(
            invalid.select(
                F.lit(job.name).alias("job"),
                F.col(WINDOW_COL).cast("bigint").alias("window_id"),
                F.col("_source_file").alias("source_file"),
                F.col("_source_line").alias("source_line"),
                F.col("_raw_text").alias("raw_line"),
                F.col("_reason").alias("reason"),
                F.col(WINDOW_COL),
            )
        )
    return {
        name: _materialise(
            reduce(lambda a, b: a.unionByName(b), frames), workdir / "expected" / name
        )
        for name, frames in parts.items()
    }


def _materialise(df: DataFrame, path: Path) -> DataFrame:
    df.write.mode("overwrite").parquet(str(path))
    return df.sparkSession.read.parquet(str(path))
