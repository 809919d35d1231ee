"""Operations that commit windows: run, backfill, restate, and skip (which gives them up).

A `run_id` names the request: given again (a retry), it is the same request. The ledger and the
sinks record each window once, so a retried run or backfill commits only what the first attempt
did not; a retried restatement has the same request id (the run id unless one is named), so
each of its windows is restated once.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from onceflow.engine import WindowResult
from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._results import SkipResult, WindowDone, WindowsResult

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.settings import Settings


def run(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    run_id: str | None = None,
    guarantee: str | None = None,
    max_units_per_window: int | None = None,
    follow: bool = False,
    poll_interval_s: float = 1.0,
    stop: threading.Event | None = None,
    on_window: Callable[[WindowResult], None] | None = None,
    on_idle: Callable[[], None] | None = None,
) -> WindowsResult:
    """Replay pending windows, finish unfinished restatements, then commit all visible new input
    (and, with `follow`, new input as it lands until `stop` is set). `on_window` is called after
    each window, `on_idle` each time a follow run found no new input (`Engine.run`)."""
    engine = open_engine(job, settings, spark=spark, dsn=dsn, guarantee=guarantee)
    done = engine.run(
        max_units_per_window=max_units_per_window,
        run_id=run_id or uuid.uuid4().hex,
        follow=follow,
        poll_interval_s=poll_interval_s,
        stop=stop,
        on_window=on_window,
        on_idle=on_idle,
    )
    windows = tuple(WindowDone.of(w) for w in done.windows)
    return WindowsResult(
        "run",
        engine.job.name,
        done.run_id,
        windows,
        noop_windows=tuple(w.window_id for w in windows if w.noop),
        epoch=done.epoch,
    )


def backfill(
    job: JobRef,
    window_ids: Sequence[int],
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    run_id: str | None = None,
) -> WindowsResult:
    """Bring chosen past windows into every sink: pending ones are replayed, those every sink
    holds are left alone (`noop_windows`), damage from outside is named in `notes`.

    Raises:
        ConfigurationError: A window was never planned.
    """
    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    run_id = run_id or uuid.uuid4().hex
    done = engine.backfill(list(window_ids), run_id)
    windows = tuple(WindowDone.of(w) for w in done.windows)
    noop = [*done.noop_windows, *(w.window_id for w in windows if w.noop)]
    return WindowsResult(
        "backfill",
        engine.job.name,
        run_id,
        windows,
        noop_windows=tuple(noop),
        notes=tuple(done.notes),
    )


def restate(
    job: JobRef,
    window_ids: Sequence[int],
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    run_id: str | None = None,
    request_id: str | None = None,
    source_replaced: bool = False,
) -> WindowsResult:
    """Replace the windows' effect in every sink with the job's current transform.

    `request_id` defaults to `run_id`: a retry with the same run id restates each window once
    (the windows a first attempt finished come back as `noop_windows`).
    """
    from onceflow.restate import restate_windows

    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    run_id = run_id or uuid.uuid4().hex
    request_id = request_id or run_id
    done = restate_windows(
        engine,
        list(window_ids),
        request_id=request_id,
        run_id=run_id,
        source_replaced=source_replaced,
    )
    windows = tuple(WindowDone.of(w) for w in done)
    return WindowsResult(
        "restate",
        engine.job.name,
        run_id,
        windows,
        noop_windows=tuple(w.window_id for w in windows if w.noop),
        request_id=request_id,
    )


def skip(
    job: JobRef,
    window_ids: Sequence[int],
    reason: str,
    settings: Settings | None = None,
    *,
    dsn: str | None = None,
    run_id: str | None = None,
) -> SkipResult:
    """Give up pending windows whose input is gone or changed, recording why (no Spark).
    Skipping a skipped window again changes nothing.

    Raises:
        ConfigurationError: No reason; a window never planned, completed, or partly held.
    """
    engine = open_engine(job, settings, dsn=dsn)
    run_id = run_id or f"skip-{uuid.uuid4().hex}"
    skipped = engine.skip(list(window_ids), reason, run_id)
    return SkipResult(engine.job.name, tuple(skipped), reason.strip(), run_id)
