"""Backfill: chosen past windows brought into every sink, or said to be there already."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onceflow.errors import ConfigurationError
from onceflow.window.context import JobContext
from onceflow.window.results import BackfillResult, WindowResult
from onceflow.windows import format_windows


def backfill(
    ctx: JobContext,
    window_ids: Sequence[int],
    replay_pending: Callable[[], list[WindowResult]],
) -> BackfillResult:
    """Bring chosen past windows into every sink: pending ones are replayed (by
    `replay_pending`, a run that plans nothing new); a window every sink holds is left alone
    and said to be; a completed window a sink lacks is damage from outside onceflow, which
    only reconcile repairs.

    Raises:
        ConfigurationError: A window was never planned.
    """
    ctx.prepare()
    last = ctx.ledger.last_window_id()
    unplanned = [wid for wid in window_ids if wid > last]
    if unplanned:
        raise ConfigurationError(
            f"windows {format_windows(unplanned)} were never planned (the last planned window "
            f"is {last}); windows are planned by a run for new data."
        )
    report = BackfillResult()
    state = ctx.held(window_ids)
    for sink, ids in ctx.ledger.abandoned().items():  # a known gap is not damage
        for wid in set(ids) & set(window_ids):
            state[wid].add(sink)
    every = set(ctx.sink_names)
    replay = False
    for wid in window_ids:
        window = ctx.ledger.window(wid)
        if window is not None and window.skipped is not None:
            report.notes.append(f"window {wid} was skipped ({window.skipped}); left alone.")
            continue
        if state[wid] >= every:
            report.noop_windows.append(wid)
            continue
        if window is not None and window.completed:
            report.notes.append(
                f"window {wid} is marked completed but {sorted(every - state[wid])} do not "
                "hold it: damage from outside onceflow; run reconcile (the recovery job)."
            )
        else:
            replay = True
    if replay:
        report.windows = replay_pending()
    return report
