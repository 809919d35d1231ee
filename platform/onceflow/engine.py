"""The engine: plans windows ahead, computes them once, and commits them to every sink once.

`Engine` presents one job's operations; each is a path in `onceflow.runs` that drives windows
through the stages of `onceflow.window` (plan → compute → prepare → commit → complete).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from onceflow._keyindex import IndexState, StagedKeys
from onceflow.job import Guarantee, Job
from onceflow.ledger import Window
from onceflow.runs import backfill as _backfill
from onceflow.runs import holds, replay
from onceflow.runs import restate as _restate
from onceflow.runs import run as _run
from onceflow.runs import skip as _skip
from onceflow.settings import Settings
from onceflow.window import compute, keys, pipeline
from onceflow.window import plan as _plan
from onceflow.window.context import JobContext
from onceflow.window.outputs import KEYS_OUTPUT, WindowOutputs, window_stats
from onceflow.window.plan import DEFAULT_MAX_UNITS_PER_WINDOW
from onceflow.window.results import (
    BackfillResult,
    RecoveryResult,
    Replayed,
    RunResult,
    WindowResult,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class Engine(JobContext):
    """Runs one job against one set of settings, on one Spark session.

    Its state (job, settings, ledger, sink groups, key index, start-up) is the `JobContext`
    every stage reads; each method here is one path of `onceflow.runs` or one stage.
    """

    # -- commit state -------------------------------------------------------------------------

    def lacking_windows(self) -> dict[str, list[int]]:
        """For each sink, the windows the ledger marks completed that it does not hold.

        A completed window is one every sink held when it was marked; a sink lacking one lost it
        afterwards (a lake deleted, repointed or restored from an older backup). Skipped windows
        were never completed; a window abandoned for a sink (`onceflow windows abandon`) is a
        known gap there, not a lacking window.
        """
        return holds.lacking(self, holds.completed_unverified(self))

    def check_sinks_hold_completed(self) -> None:
        """Refuse to compute anything while a sink lacks windows the ledger says it holds."""
        holds.check_sinks_hold_completed(self)

    def incomplete_windows(self, windows: Sequence[Window]) -> dict[int, list[str]]:
        """Windows some sink does not hold, with the sinks that lack them."""
        return holds.incomplete_windows(self, windows)

    def replay_problems(self, window: Window) -> list[str]:
        """What keeps `window` from being computed again; empty when it can be replayed."""
        return holds.replay_problems(self, window)

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        *,
        max_units_per_window: int | None = None,
        run_id: str | None = None,
        follow: bool = False,
        poll_interval_s: float = 1.0,
        stop: threading.Event | None = None,
        on_window: Callable[[WindowResult], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        max_windows: int | None = None,
    ) -> RunResult:
        """Replay pending windows, then plan and commit windows for all visible new input.

        Args:
            max_units_per_window: Most units (files, table versions) a new window takes.
            run_id: An id for this run, recorded with every commit.
            follow: Keep running and commit new input as it appears, until `stop` is set.
            poll_interval_s: How often `follow` looks for new input.
            stop: Set it to end a `follow` run after the current window.
            on_window: Called after each window.
            on_idle: Called by `follow` each time a look for new input found none, before it
                waits: work that must not overlap a commit (checks) can run there.
            max_windows: Plan at most this many new windows (0: only replay pending ones).
        """
        return _run.run(
            self,
            max_units_per_window=max_units_per_window,
            run_id=run_id,
            follow=follow,
            poll_interval_s=poll_interval_s,
            stop=stop,
            on_window=on_window,
            on_idle=on_idle,
            max_windows=max_windows,
        )

    def unplanned_units(self) -> list[str]:
        """Visible input no window has taken yet, in source order."""
        return _plan.unplanned_units(self)

    def process_window(self, window: Window, epoch: int, run_id: str) -> WindowResult:
        """Commit `window` to every sink that does not hold it yet."""
        return pipeline.process_window(self, window, epoch, run_id)

    def recover(self, run_id: str) -> RecoveryResult:
        """Put back completed windows a sink lost (as reconcile does), then run: pending windows,
        unfinished restatements and input no window has planned yet."""
        restored: dict[str, list[int]] = {}
        if self.job.guarantee is not Guarantee.NONE and self.lacking_windows():
            restored = self.replay_lacking(self.start(run_id), run_id).restored
        return RecoveryResult(self.run(run_id=run_id), restored)

    def replay_lacking(self, epoch: int, run_id: str) -> Replayed:
        """Commit, in window order, the completed windows some sink lacks, to those sinks only
        (`onceflow.runs.replay`)."""
        return replay.replay_lacking(self, epoch, run_id)

    def skip(self, window_ids: Sequence[int], reason: str, run_id: str | None = None) -> list[int]:
        """Give up pending windows whose input is gone or changed, recording why
        (`onceflow.runs.skip`).

        Raises:
            ConfigurationError: No reason, a window never planned, completed, or partly held.
        """
        return _skip.skip(self, window_ids, reason, run_id)

    # -- restatements -------------------------------------------------------------------------

    def planned_restatements(self) -> list[tuple[Window, int]]:
        """Restatements written ahead but not finished, as (window, sequence number)."""
        return _restate.planned_restatements(self)

    def restate(
        self, todo: Sequence[tuple[Window, int]], epoch: int, run_id: str
    ) -> list[WindowResult]:
        """Apply planned restatements: every check first, then each window in every sink."""
        return _restate.restate(self, todo, epoch, run_id)

    def backfill(self, window_ids: Sequence[int], run_id: str) -> BackfillResult:
        """Bring chosen past windows into every sink (`onceflow.runs.backfill`).

        Raises:
            ConfigurationError: A window was never planned.
        """
        return _backfill.backfill(
            self, window_ids, lambda: self.run(run_id=run_id, max_windows=0).windows
        )

    # -- computing ----------------------------------------------------------------------------

    def ensure_index(self, window_id: int, epoch: int | None = None) -> IndexState | None:
        """Make the key index hold exactly the completed windows before `window_id`
        (`onceflow.window.keys`)."""
        return keys.ensure_index(self, window_id, epoch)

    def outputs(
        self,
        window: Window,
        *,
        stage_tag: str = "",
        seen_also: Sequence[StagedKeys] = (),
        planned: bool = False,
        epoch: int | None = None,
    ) -> WindowOutputs:
        """The window's outputs and stats, the same rows for every sink and every retry
        (`onceflow.window.compute`)."""
        return compute.outputs(
            self, window, stage_tag=stage_tag, seen_also=seen_also, planned=planned, epoch=epoch
        )


def build_engine(
    job: Job,
    settings: Settings,
    spark: SparkSession | None,
    dsn: str,
    guarantee: Guarantee | str | None = None,
) -> Engine:
    """Make an engine after checking the settings' folders."""
    settings.check_folders()
    return Engine(job, settings, spark, dsn, guarantee=guarantee)


__all__ = [
    "DEFAULT_MAX_UNITS_PER_WINDOW",
    "KEYS_OUTPUT",
    "BackfillResult",
    "Engine",
    "RecoveryResult",
    "Replayed",
    "RunResult",
    "WindowOutputs",
    "WindowResult",
    "build_engine",
    "window_stats",
]
