"""Restatement: replace exactly one window's effect in every sink, one commit per sink.

A restatement is planned in the ledger first (so a retry of the same request applies it once),
then each sink replaces the window: the Delta table in one commit that removes the window's
rows and adds the new ones; a keyed PostgreSQL table in one transaction that deletes the
window's rows and inserts the new ones; an accumulating table in one transaction that adds the
new contribution minus the old one.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from onceflow._staging import WindowStage
from onceflow.engine import SinkOutcome, WindowResult
from onceflow.errors import SinkError
from onceflow.job import DeltaSink, PostgresSink

if TYPE_CHECKING:
    from onceflow.engine import Engine


def restate_window(
    engine: Engine, window_id: int, *, run_id: str | None = None, request_id: str | None = None
) -> WindowResult:
    """Recompute `window_id` with the job's current transform and replace its effect.

    Args:
        engine: The job's engine.
        window_id: A window committed in every sink.
        run_id: This run's id, recorded with the commits.
        request_id: Identifies the request; retries of one request restate once. Defaults to
            `run_id`.
    """
    started = time.monotonic()
    engine.prepare()
    run_id = run_id or uuid.uuid4().hex
    ledger = engine.ledger
    epoch = ledger.acquire_epoch(run_id, floor=engine.sink_epoch_floor())
    for delta in engine.delta.values():
        if delta.exists():
            delta.claim_epoch(epoch)
    window = ledger.window(window_id)
    if window is None:
        raise SinkError(f"job {engine.job.name}: there is no window {window_id} to restate.")
    missing = {s.name for s in engine.job.sinks} - engine.committed_sinks(window_id)
    if missing:
        raise SinkError(
            f"job {engine.job.name}: window {window_id} is not committed in {sorted(missing)}; "
            "run the job (or its recovery) before restating it."
        )
    seq = ledger.plan_restatement(epoch, window_id, request_id or run_id)
    tag = f"-r{seq}"
    outputs, stats = engine.outputs(window, stage_tag=tag)
    result = WindowResult(window_id, window.offsets, stats)
    for sink in engine.job.sinks:
        t0 = time.monotonic()
        if isinstance(sink, DeltaSink):
            commit = engine.delta[sink.name].replace_window(
                outputs[sink.output], window_id=window_id, epoch=epoch, run_id=run_id,
                restate_seq=seq,
            )  # fmt: skip
            result.sinks[sink.name] = SinkOutcome(
                sink.name, not commit.already_committed, commit.already_committed, commit.rows,
                delta_version=commit.version, latency_s=time.monotonic() - t0,
            )  # fmt: skip
            continue
        assert isinstance(sink, PostgresSink)
        contributions = engine.contributions(sink.name)
        old = None
        if sink.mode == "accumulate" and contributions.exists(window_id):
            old = contributions.read(engine.spark, window_id)
        pg = engine.postgres[sink.name].restate_window(
            outputs[sink.output], old, window_id=window_id, epoch=epoch, run_id=run_id, seq=seq
        )
        if sink.mode == "accumulate":
            stage = WindowStage(engine.settings.lake, engine.job.name, window_id, tag)
            contributions.save(window_id, stage.root / sink.output, replace=True)
        result.sinks[sink.name] = SinkOutcome(
            sink.name, not pg.already_committed, pg.already_committed, pg.rows, xid=pg.xid,
            latency_s=time.monotonic() - t0,
        )  # fmt: skip
    ledger.record_stats(window_id, stats)
    ledger.complete_restatement(seq)
    WindowStage(engine.settings.lake, engine.job.name, window_id, tag).discard()
    result.latency_s = time.monotonic() - started
    return result
