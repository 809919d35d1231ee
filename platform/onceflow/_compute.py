"""The one compute path: source → parse → quarantine → dedupe → transform.

Run, restatement and reconcile all compute a job's outputs here, for one window or for a
sequence of windows. The first valid occurrence of each dedupe key in source order (window,
unit, position) is kept, over the whole sequence and against `seen`, the keys earlier windows
kept (from the dedupe state sink) — so a window computed alone and the same window computed
inside a sequence give the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError
from onceflow.job import Job, WindowContext
from onceflow.sources.base import RAW_TEXT_COLUMN, REASON_COLUMN
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.ledger import Window
    from onceflow.settings import Settings

PARSED = "_parsed"
KEPT = "_kept"


@dataclass(frozen=True)
class Computed:
    """A computation's materialised intermediates and its outputs (each with WINDOW_COL)."""

    parsed: DataFrame
    kept: DataFrame
    outputs: dict[str, DataFrame]


def materialise(df: DataFrame, path: Path) -> DataFrame:
    """Write `df` on the executors and return a frame reading the written copy."""
    df.write.mode("overwrite").parquet(str(path))
    return df.sparkSession.read.parquet(str(path))


def _parsed(
    spark: SparkSession, job: Job, settings: Settings, windows: Sequence[Window]
) -> DataFrame:
    from pyspark.sql import functions as F

    parse = job.parse or (lambda raw: raw)
    source = job.source
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
        return (
            parse(raw)
            .withColumnRenamed("_file_idx", "__global")
            .join(F.broadcast(positions), "__global")
            .drop("__global")
            .withColumnRenamed("__local", "_file_idx")
        )
    frames = [
        parse(source.read(spark, settings, w.offsets)).withColumn(
            WINDOW_COL, F.lit(w.window_id).cast("bigint")
        )
        for w in windows
    ]
    return reduce(lambda a, b: a.unionByName(b), frames)


def compute(
    spark: SparkSession,
    job: Job,
    settings: Settings,
    windows: Sequence[Window],
    workdir: Path,
    *,
    seen: DataFrame | None = None,
) -> Computed:
    """Compute `job`'s outputs for `windows` (in window order).

    Args:
        spark: The Spark session.
        job: The job.
        settings: Where the input is.
        windows: The windows, all with their input available.
        workdir: A folder for the materialised parse and dedupe results.
        seen: Dedupe key columns plus `__seen_in`: keys whose first occurrence is in that
            (earlier or unreplayable) window; later occurrences are duplicates.

    Returns:
        The parsed and kept rows (materialised) and every output, lazily, with WINDOW_COL.
    """
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    windows = sorted(windows, key=lambda w: w.window_id)
    if not windows:
        raise ConfigurationError(f"job {job.name}: nothing to compute (no windows given).")
    parsed = _parsed(spark, job, settings, windows)
    for column in (REASON_COLUMN, RAW_TEXT_COLUMN):
        if column not in parsed.columns:
            parsed = parsed.withColumn(column, F.lit(None).cast("string"))
    parsed = materialise(parsed, workdir / PARSED)
    valid = parsed.where(F.col(REASON_COLUMN).isNull())
    invalid = parsed.where(F.col(REASON_COLUMN).isNotNull())
    if job.dedupe is not None:
        keys = list(job.dedupe.key)
        missing = [k for k in keys if k not in valid.columns]
        if missing:
            raise ConfigurationError(
                f"job {job.name}: dedupe key {missing} is not a column of the parsed records."
            )
        if seen is not None:
            valid = (
                valid.join(seen.select(*keys, "__seen_in"), keys, "left")
                .where(F.col("__seen_in").isNull() | (F.col(WINDOW_COL) < F.col("__seen_in")))
                .drop("__seen_in")
            )
        first = W.partitionBy(*keys).orderBy(WINDOW_COL, "_file_idx", "_source_line")
        valid = (
            valid.withColumn("__occurrence", F.row_number().over(first))
            .where(F.col("__occurrence") == 1)
            .drop("__occurrence")
        )
    kept = materialise(valid, workdir / KEPT)
    parts: dict[str, list[DataFrame]] = {}
    for window in windows:
        rows = kept.where(F.col(WINDOW_COL) == window.window_id).drop(WINDOW_COL)
        produced = job.transform(rows, WindowContext(job.name, window.window_id))
        for name, df in produced.items():
            parts.setdefault(name, []).append(
                df.withColumn(WINDOW_COL, F.lit(window.window_id).cast("bigint"))
            )
    if job.quarantine_sink is not None:
        parts.setdefault(job.sink(job.quarantine_sink).output, []).append(
            invalid.select(
                F.lit(job.name).alias("job"),
                F.col(WINDOW_COL).cast("bigint").alias("window_id"),
                F.col("_source_file").alias("source_file"),
                F.col("_source_line").cast("bigint").alias("source_line"),
                F.coalesce(F.col(RAW_TEXT_COLUMN), F.lit("")).alias("raw_line"),
                F.col(REASON_COLUMN).alias("reason"),
                F.col(WINDOW_COL),
            )
        )
    outputs = {
        name: reduce(lambda a, b: a.unionByName(b), frames) for name, frames in parts.items()
    }
    wanted = {s.output for s in job.sinks}
    absent = sorted(wanted - set(outputs))
    if absent:
        raise ConfigurationError(
            f"job {job.name}: the transform gave no output named {absent}; it gave "
            f"{sorted(outputs)}. Every sink's `output` must be one of them."
        )
    return Computed(parsed, kept, outputs)
