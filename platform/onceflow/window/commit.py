"""Commit: a prepared window committed to every sink, in order, then completed."""

from __future__ import annotations

import time

from onceflow import faults
from onceflow.window.complete import add_records, begin_completing, complete
from onceflow.window.context import JobContext
from onceflow.window.prepare import Prepared, drop_keys
from onceflow.window.results import WindowResult, commits


def commit(ctx: JobContext, prepared: Prepared, keep_keys: bool = False) -> WindowResult:
    """Commit a prepared window to its sinks, in order, and complete it (`complete`: marked
    completed, its staged dedupe keys into the key index in that same transaction).
    `keep_keys`: leave the staged keys for the next window's lookups (it drops them)."""
    window, epoch, run_id = prepared.window, prepared.epoch, prepared.run_id
    result, out = prepared.result, prepared.out
    if out is None:  # every sink held it
        add_records(ctx, window.window_id, result.sinks)
        complete(ctx, window.window_id, None, {}, commits(result.sinks))
        prepared.stage.discard()
        result.latency_s = result.visible_s = time.monotonic() - prepared.started
        return result
    completing = None
    try:
        ctx.ledger.record_stats(window.window_id, result.stats)
        faults.point("before_sinks", window.window_id)
        completing = begin_completing(ctx, window.window_id, epoch, prepared.keys, prepared.results)
        for group, write in prepared.writes:
            with out.bound(ctx.spark_or_none):  # a staged copy lost is written again
                outcomes = group.finish(
                    window, write, prepared.results, out.frames, epoch=epoch,
                    run_id=run_id, exactly_once=ctx.exactly_once,
                )  # fmt: skip
            result.sinks.update(outcomes)
            faults.point(group.fault_after_commit, window.window_id)
        faults.point("after_commits", window.window_id)
        result.visible_s = time.monotonic() - prepared.started
        if ctx.exactly_once:
            ctx.ledger.check_epoch(epoch)
        add_records(ctx, window.window_id, result.sinks)
        complete(
            ctx, window.window_id, prepared.keys, prepared.results, commits(result.sinks),
            completing,
        )  # fmt: skip
    finally:
        if completing is not None:
            completing.abandon()  # committed or given up by now, unless the commit failed
        out.release()
        if not keep_keys:
            drop_keys(ctx, prepared)
    prepared.stage.discard()
    result.latency_s = time.monotonic() - prepared.started
    return result
