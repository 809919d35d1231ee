"""Restate: planned restatements applied, each window's outputs computed again into every sink."""

from __future__ import annotations

import time
from collections.abc import Sequence

from onceflow import faults
from onceflow.errors import SinkError
from onceflow.ledger import Window
from onceflow.window.compute import outputs
from onceflow.window.context import JobContext
from onceflow.window.results import WindowResult, commits


def request_of(request_id: str) -> str:
    """The request a restatement's id belongs to (`<request>/w<window>` → `<request>`)."""
    head, sep, tail = request_id.rpartition("/w")
    return head if sep and tail.isdigit() else request_id


def cancel_command(job: str, request_id: str) -> str:
    """The command that cancels the unfinished restatements of `request_id`'s request."""
    return f"onceflow restate {job} --cancel {request_of(request_id)}"


def check_unfinished(engine: JobContext, todo: Sequence[tuple[Window, int]]) -> None:
    """Raise SinkError, naming the command that cancels it, if an unfinished restatement
    cannot be applied (a sink changed since it was planned, say): checked before any of them
    changes a sink, and before a new request is recorded behind it."""
    if not todo:
        return
    job = engine.job.name
    requests = {seq: rid for seq, _, rid in engine.ledger.pending_restatements()}
    for window, seq in todo:
        for group in engine.groups:
            try:
                group.check_restate(window)
            except SinkError as exc:
                rid = requests.get(seq, "")
                raise SinkError(
                    f"job {job}: the unfinished restatement of window {window.window_id} (seq "
                    f"{seq}, request {request_of(rid)}) cannot be applied: {exc.message} Cancel "
                    f"it with `{cancel_command(job, rid)}`, then run the job again."
                ) from None


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
