"""Recovery: what a job needs after a crash, a lost sink or a failed run, in one operation."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._results import RecoverResult, WindowDone

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.settings import Settings

# How many of the newest windows a recovery verifies by default (0: every window).
VERIFY_LAST = 1000


def recover(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    run_id: str | None = None,
    verify_last: int = VERIFY_LAST,
    reconcile: Literal["incremental", "full", "off"] = "incremental",
    dry_run: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> RecoverResult:
    """Put back completed windows a sink lost, replay pending windows and unfinished
    restatements, commit input no window has planned yet (a run that died before planning it
    left it there), verify that every sink holds the last `verify_last` windows, then reconcile
    the sinks with what they should hold (`reconcile`: `incremental`, `full` or `off`).

    Safe to run at any time and again: each step does only what is still missing.
    """
    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    run_id = run_id or uuid.uuid4().hex
    step = on_step or (lambda _text: None)
    step("replaying")
    recovered = engine.recover(run_id)
    windows = engine.ledger.windows()
    if verify_last:
        windows = windows[-verify_last:]
    step("verifying")
    incomplete = engine.incomplete_windows(windows)
    report = None
    if reconcile != "off":
        from onceflow.reconcile import reconcile as reconcile_job

        report = reconcile_job(engine, dry_run=dry_run, mode=reconcile, on_step=on_step)
    return RecoverResult(
        engine.job.name,
        run_id,
        restored=recovered.restored,
        replayed=tuple(WindowDone.of(w) for w in recovered.run.windows),
        verified=tuple(w.window_id for w in windows),
        incomplete=incomplete,
        reconcile=report,
        epoch=recovered.run.epoch,
    )
