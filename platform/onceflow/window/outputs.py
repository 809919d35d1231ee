"""A window's outputs ready for the sinks, with their stats."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any

from onceflow import _window_params as window_params
from onceflow._compute import Computed
from onceflow._keyindex import Basis, StagedKeys
from onceflow.sinks.writers import (
    WRITERS_PARAM,
    PartitionWriter,
    WriteResults,
    WritersPlan,
    rows_written,
    run_writers,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The internal output carrying a window's kept dedupe keys to the key index's staging table.
KEYS_OUTPUT = "__dedupe_keys"
# The measures of a window's write job that make its stats: the rows read, invalid and kept;
# and the rows of each output that no writer writes this time (its sinks held the window).
_COUNTS = "counts"
_UNWRITTEN_ROWS = "unwritten_rows"


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

    def measures(self, writers: Sequence[PartitionWriter]) -> dict[str, DataFrame]:
        """What the sink write computes too, to know the stats (`counted`): the counts, and
        the rows of each output that no writer writes (a writer counts its output's rows)."""
        if self.stats is not None or self.computed is None:
            return {}
        from pyspark.sql import functions as F

        written = {w.output for w in writers}
        measures = {_COUNTS: self.computed.counts_frame()}
        unwritten = [
            df.agg(F.to_json(F.create_map(F.lit(name), F.count(F.lit(1)))).alias("result"))
            for name, df in self.frames.items()
            if name not in written and name != KEYS_OUTPUT
        ]
        if unwritten:
            measures[_UNWRITTEN_ROWS] = reduce(lambda a, b: a.unionAll(b), unwritten)
        return measures

    def counted(self, job: WriteResults, writers: Sequence[PartitionWriter]) -> dict[str, Any]:
        """The stats, from a sink write that computed `measures(writers)`."""
        if self.stats is None:
            self.stats = window_stats(job.measured[_COUNTS], quarantine=self.quarantine)
            by_output = {w.output: rows_written(job.written[w.key]) for w in writers}
            unwritten = job.measured.get(_UNWRITTEN_ROWS, {})
            self.stats["outputs"] = {
                name: by_output[name] if name in by_output else int(unwritten.get(name, 0))
                for name in self.frames
                if name != KEYS_OUTPUT
            }
        return self.stats

    def count(self) -> dict[str, Any]:
        """The stats, counted now (one Spark job) if no sink write counted them."""
        if self.stats is None:
            return self.counted(run_writers(self.frames, [], self.measures([])), [])
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
