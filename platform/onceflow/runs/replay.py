"""Replay: completed windows some sink lost, committed again to those sinks only."""

from __future__ import annotations

import logging

from onceflow.runs.holds import completed_unverified, lacking, replay_problems
from onceflow.window.context import JobContext
from onceflow.window.pipeline import process_window
from onceflow.window.results import Replayed

_log = logging.getLogger(__name__)


def replay_lacking(ctx: JobContext, epoch: int, run_id: str) -> Replayed:
    """Commit, in window order, the completed windows some sink lacks, to those sinks only.

    Window order matters: each replayed window's dedupe sees the windows before it, which
    the state sink holds again by then. Windows whose input (and stage) is gone stay lacking,
    and so do later windows in the sinks that lack one of them: committed on top of the
    gap, they would hide it. Once the operator abandons the gap for those sinks (`onceflow
    windows abandon`), the next reconcile replays them.
    """
    # Only the completed windows above the sinks' held floor can be lacking (`holds`).
    windows = {w.window_id: w for w in completed_unverified(ctx)}
    lacks = lacking(ctx, list(windows.values()))
    for group in ctx.groups:
        group.prepare_replay()
    replayed = Replayed()
    blocked: set[str] = set()  # sinks lacking a window whose input is gone
    try:
        for wid in sorted({wid for wids in lacks.values() for wid in wids}):
            window = windows[wid]
            sinks = [name for name, ids in lacks.items() if wid in ids]
            problems = replay_problems(ctx, window)
            if problems:
                _log.warning("window %d cannot be replayed: %s", wid, "; ".join(problems[:3]))
                replayed.gone.append(wid)
                blocked.update(sinks)
            elif not blocked.intersection(sinks):
                process_window(ctx, window, epoch, run_id)
                for name in sinks:
                    replayed.restored.setdefault(name, []).append(wid)
                continue
            for name in sinks:
                replayed.left.setdefault(name, []).append(wid)
    finally:
        for group in ctx.groups:
            group.end_replay()
        ctx.plans.forget()
    return replayed
