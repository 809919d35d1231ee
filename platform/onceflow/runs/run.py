"""A run: pending windows replayed, unfinished restatements finished, then new input planned
and committed window by window (and, following, as it lands)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from onceflow.errors import ConfigurationError
from onceflow.runs.changed import warn_changed_input
from onceflow.runs.holds import check_sinks_hold_completed
from onceflow.runs.restate import planned_restatements, restate
from onceflow.window.context import JobContext
from onceflow.window.pipeline import process
from onceflow.window.plan import LedgerChangedUnderRun, plan
from onceflow.window.results import RunResult, WindowResult

_log = logging.getLogger(__name__)


def run(
    ctx: JobContext,
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
    """Replay pending windows, then plan and commit windows for all visible new input
    (`onceflow.engine.Engine.run` says what each argument does)."""
    if max_units_per_window is not None and max_units_per_window < 1:
        raise ConfigurationError("max files (units) per window must be at least 1.")
    run_id = run_id or uuid.uuid4().hex
    # Mistakes a user fixes by hand are refused before anything is taken or computed.
    ctx.job.source.check_input(ctx.settings)
    ctx.prepare()
    for group in ctx.groups:
        group.check_tables()
    epoch = ctx.start(run_id)
    check_sinks_hold_completed(ctx)
    warn_changed_input(ctx)
    result = RunResult(ctx.job.name, run_id, epoch)

    def done(window_result: WindowResult) -> None:
        result.windows.append(window_result)
        if on_window:
            on_window(window_result)

    def finish_earlier_work() -> None:
        process(ctx, iter(ctx.ledger.windows(pending_only=True)), epoch, run_id, done)
        # A restatement interrupted by a crash is finished by the next run, with its
        # request's sequence numbers, so each of its windows changes once.
        restate(ctx, planned_restatements(ctx), epoch, run_id)

    # The windows' plans (a follow run's too) hold from poll to poll; they go at the end.
    try:
        finish_earlier_work()
        stop = stop or threading.Event()
        planned = 0
        while max_windows is None or planned < max_windows:
            try:
                found = process(
                    ctx,
                    plan(ctx, epoch, max_units_per_window),
                    epoch,
                    run_id,
                    done,
                    stop=stop,
                    limit=None if max_windows is None else max_windows - planned,
                )
            except LedgerChangedUnderRun:
                # Rows removed under the run (a window's units among them) are put back from
                # the sinks' records and the windows' plans, as a run's start-up does.
                _log.warning(
                    "job %s: rows of the ledger were removed while this run went on; it "
                    "checks the ledger again (and rebuilds what it can) before it plans more",
                    ctx.job.name,
                )
                epoch = ctx.start(run_id)
                check_sinks_hold_completed(ctx)
                finish_earlier_work()  # a window rebuilt from the sinks' records among them
                continue
            planned += found
            if not follow or stop.is_set() or (max_windows is not None and planned >= max_windows):
                break
            if found:
                continue  # more may have landed while these committed: look again at once
            if on_idle is not None:
                on_idle()
            if stop.wait(poll_interval_s):
                break
    finally:
        ctx.plans.forget()
    return result
