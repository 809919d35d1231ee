"""Restate: planned restatements applied, each window's outputs computed again into every sink."""

from __future__ import annotations

import time
from collections.abc import Sequence

from onceflow import faults
from onceflow.ledger import Window
from onceflow.window.compute import outputs
from onceflow.window.context import JobContext
from onceflow.window.results import WindowResult, commits


def planned_restatements(ctx: JobContext) -> list[tuple[Window, int]]:
    """Restatements written ahead but not finished, as (window, sequence number)."""
    out = []
    for seq, wid, _ in ctx.ledger.pending_restatements():
        window = ctx.ledger.window(wid)
        if window is not None:
            out.append((window, seq))
    return out


def restate(
    ctx: JobContext, todo: Sequence[tuple[Window, int]], epoch: int, run_id: str
) -> list[WindowResult]:
    """Apply planned restatements: every check first, then each window in every sink."""
    from onceflow.restate import check_unfinished

    check_unfinished(ctx, todo)
    results = []
    for window, seq in todo:
        t0 = time.monotonic()
        stage = ctx.stage(window, f"-r{seq}")
        out = outputs(ctx, window, stage=stage, epoch=epoch)
        result = WindowResult(window.window_id, window.offsets, out.count())
        try:
            for group in ctx.groups:
                result.sinks.update(
                    group.restate(window, out.frames, epoch=epoch, run_id=run_id, seq=seq)
                )
        finally:
            out.release()
        faults.point("restated", window.window_id)
        result.visible_s = time.monotonic() - t0
        ctx.ledger.record_stats(window.window_id, result.stats)
        ctx.ledger.complete_restatement(seq, window.window_id, commits(result.sinks))
        stage.discard()
        result.latency_s = time.monotonic() - t0
        results.append(result)
    return results
