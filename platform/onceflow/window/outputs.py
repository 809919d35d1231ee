"""A window's outputs ready for the sinks, with their stats."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow import _window_params as window_params
from onceflow._compute import COUNTS, Computed
from onceflow._keyindex import Basis, StagedKeys
from onceflow.sinks.writers import (
    WRITERS_PARAM,
    PartitionWriter,
    WritersPlan,
    rows_written,
    run_writers,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The internal output carrying a window's kept dedupe keys to the key index's staging table.
KEYS_OUTPUT = "__dedupe_keys"
# Under this prefix and an output's name, the sink write reports the rows of an output that no
# writer writes this time (its sinks held the window).
_ROWS = "__rows/"


@dataclass
class WindowOutputs:
    """A window's outputs ready for the sinks, with its stats.

    Attributes:
        frames: Every output; KEYS_OUTPUT too when the job dedupes.
        stats: Rows read, quarantined, kept, …; None until the sink write counts them
            (`counted`), or `count` does.
        computed: Cached intermediates to release; None when the outputs were read staged.
    """

    frames: dict[str, DataFrame]
    stats: dict[str, Any] | None
    computed: Computed | None = None
    quarantine: bool = False  # whether invalid rows go to a quarantine sink
    #: The window's parameters, when its frames were planned for any window: the Spark jobs
    #: that compute them must run inside `bound`.
    params: dict[str, Any] | None = None
    #: The plan slot the frames come from (with `params`).
    slot: int | None = None
    #: The earlier windows its dedupe saw (None: the job does not dedupe by the key index).
    basis: Basis | None = None
    #: Staged keys its lookups read that `basis` does not count yet: each counts once it is
    #: found whole after the lookups (`KeyIndex.confirm`).
    looked_up: tuple[StagedKeys, ...] = ()

    def bound(
        self,
        spark: SparkSession | None,
        writers: WritersPlan | None = None,
        written: Sequence[PartitionWriter] = (),
    ) -> contextlib.AbstractContextManager[None]:
        """Around the Spark jobs of this thread that compute the frames; with `writers`, the
        job of that plan, writing `written`."""
        if self.params is None or spark is None:
            return contextlib.nullcontext()
        params = self.params
        if writers is not None:
            params = {**params, WRITERS_PARAM: writers.params(written)}
        return window_params.bound(spark, params)

    def count_frames(self, writers: Sequence[PartitionWriter]) -> list[DataFrame]:
        """What the sink write computes too, to know the stats (`counted`): the counts, and
        the rows of each output that no writer writes (a writer counts its output's rows)."""
        if self.stats is not None or self.computed is None:
            return []
        from pyspark.sql import functions as F

        written = {w.output for w in writers}
        return [self.computed.counts_frame()] + [
            df.agg(
                F.lit(_ROWS + name).alias("writer"),
                F.to_json(F.struct(F.count(F.lit(1)).alias("rows"))).alias("result"),
            )
            for name, df in self.frames.items()
            if name not in written
        ]

    def counted(
        self,
        results: Mapping[str, Sequence[Mapping[str, Any]]],
        writers: Sequence[PartitionWriter],
    ) -> dict[str, Any]:
        """The stats, from a sink write that ran `count_frames(writers)`."""
        if self.stats is None:
            counts = {k: v for part in results[COUNTS] for k, v in part.items()}
            self.stats = window_stats(counts, quarantine=self.quarantine)
            by_output = {w.output: rows_written(results[w.key]) for w in writers}
            self.stats["outputs"] = {
                name: by_output[name]
                if name in by_output
                else rows_written(results.get(_ROWS + name, []))
                for name in self.frames
                if name != KEYS_OUTPUT
            }
        return self.stats

    def count(self) -> dict[str, Any]:
        """The stats, counted now (one Spark job) if no sink write counted them."""
        if self.stats is None:
            return self.counted(run_writers(self.frames, [], self.count_frames([])), [])
        return self.stats

    def release(self) -> None:
        if self.computed is not None:
            self.computed.release()


def window_stats(counts: Mapping[str, int], *, quarantine: bool) -> dict[str, Any]:
    """A window's stats from the rows read, invalid and kept."""
    valid = counts["rows_in"] - counts["invalid"]
    return {
        "rows_in": counts["rows_in"],
        "quarantined": counts["invalid"] if quarantine else 0,
        "valid": valid,
        "kept": counts["kept"],
        "duplicates": valid - counts["kept"],
    }
