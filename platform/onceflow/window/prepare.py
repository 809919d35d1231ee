"""Prepare: a window computed and written to every sink's staging, nothing visible yet.

The prepared window (`Prepared`) carries what later stages need: its outputs and their basis,
the writers' results, its staged dedupe keys and its stage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from onceflow import faults
from onceflow._identifiers import session_name
from onceflow._keyindex import StagedKeys
from onceflow._pgcopy import CopyWriter
from onceflow._staging import WindowStage
from onceflow.errors import LedgerError, TransientSinkError
from onceflow.ledger import Window
from onceflow.sinks.base import SinkGroup, WindowWrite
from onceflow.sinks.contract import SinkOutcome
from onceflow.sinks.writers import (
    PartitionWriter,
    WriteResults,
    WritersPlan,
    failed_writer,
    rows_written,
    run_writers,
)
from onceflow.window.compute import confirm, outputs
from onceflow.window.context import JobContext
from onceflow.window.keys import ensure_index
from onceflow.window.outputs import KEYS_OUTPUT, WindowOutputs
from onceflow.window.results import WindowResult

_log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A window computed and written to every sink's staging, not committed yet."""

    window: Window
    epoch: int
    run_id: str
    started: float
    stage: WindowStage  # its outputs' stage (a job that is not deterministic reads it again)
    result: WindowResult = field(init=False)
    out: WindowOutputs | None = None  # None: every sink held the window
    writes: list[tuple[SinkGroup, WindowWrite]] = field(default_factory=list)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    keys: CopyWriter | None = None  # the staged dedupe keys

    def __post_init__(self) -> None:
        w = self.window
        self.result = WindowResult(w.window_id, w.offsets, w.stats or {})

    def staged_keys(self) -> StagedKeys | None:
        """Its kept keys as staged, for the next window's lookups."""
        if self.keys is None or self.keys.key not in self.results:
            return None
        rows = rows_written(self.results[self.keys.key])
        return StagedKeys(self.window.window_id, self.keys.table, rows)


def prepare(
    ctx: JobContext, window: Window, epoch: int, run_id: str, before: Prepared | None = None
) -> Prepared:
    """Compute `window` and write every sink's staged copy of it (nothing visible yet).

    `before`: the window just before it, prepared but perhaps not completed yet; its staged
    dedupe keys count as seen."""
    started = time.monotonic()
    if ctx.exactly_once:
        ctx.ledger.check_epoch(epoch)
    held = ctx.committed_sinks(window.window_id) if ctx.exactly_once else set()
    prepared = Prepared(window, epoch, run_id, started, ctx.stage(window))
    prepared.result.sinks.update(
        {name: SinkOutcome(name, committed=False, already_committed=True) for name in held}
    )
    todo = [name for name in ctx.sink_names if name not in held]
    if not todo:
        return prepared
    staged = before.staged_keys() if before is not None else None
    out = prepared.out = outputs(
        ctx,
        window,
        stage=prepared.stage,
        seen_also=(staged,) if staged else (),
        planned=True,
        epoch=epoch,
    )
    try:
        prepared.writes = [
            (group, group.begin(window, out.frames, todo, epoch=epoch, run_id=run_id))
            for group in ctx.groups
        ]
        writers: list[PartitionWriter] = [w for _, write in prepared.writes for w in write.writers]
        if ctx.index is not None:
            prepared.keys = ctx.index.staging_writer(
                KEYS_OUTPUT,
                window.window_id,
                session_name(ctx.job.name, epoch),
                epoch=epoch,
                fenced=ctx.exactly_once,
            )
            faults.point("keys_staging", window.window_id)
            writers.append(prepared.keys)
        job = _write(ctx, window, out, writers, epoch)
        prepared.results = job.written
        prepared.result.compute_s = time.monotonic() - started
        prepared.result.stats = out.counted(job, writers)
        confirm(ctx, out)
    except BaseException:
        discard(ctx, prepared)
        raise
    return prepared


def fresh(ctx: JobContext, prepared: Prepared) -> Prepared:
    """`prepared` if what its dedupe saw is still every earlier window the ledger plans and
    did not skip; else the window prepared again (once the key index holds them).

    It differs when staged keys it read were lost (a server crash-restart empties UNLOGGED
    tables), or when an earlier window it saw was skipped since.

    Raises:
        LedgerError: Prepared again, it still differs.
    """
    window, epoch, run_id = prepared.window, prepared.epoch, prepared.run_id
    for attempt in range(2):
        out = prepared.out
        if out is None or out.basis is None:
            return prepared
        state = ensure_index(ctx, window.window_id, epoch)
        assert state is not None
        due = state.due
        if out.basis == due:
            return prepared
        if attempt:
            raise LedgerError(
                f"job {ctx.job.name}: window {window.window_id} must be deduplicated "
                f"against {due}, but the dedupe key index gives {out.basis}; nothing of it "
                f"was committed. Run `onceflow run {ctx.job.name}` again; if this repeats, "
                f"`onceflow status {ctx.job.name}` lists the windows pending before it."
            )
        _log.warning(
            "window %d: its dedupe saw %s but must see %s; computing it again",
            window.window_id,
            out.basis,
            due,
        )
        discard(ctx, prepared)
        prepared = prepare(ctx, window, epoch, run_id)
    return prepared


def discard(ctx: JobContext, prepared: Prepared) -> None:
    """Drop a prepared window that will not be committed (its staged copies are never
    committed; a later prepare of the window writes new ones)."""
    if prepared.out is not None:
        prepared.out.release()
    drop_keys(ctx, prepared)


def drop_keys(ctx: JobContext, prepared: Prepared) -> None:
    """Drop the window's staged dedupe keys (once no later window's lookups read them)."""
    if prepared.keys is not None and ctx.index is not None:
        ctx.index.drop_staging(prepared.keys.table)


def _write(
    ctx: JobContext,
    window: Window,
    out: WindowOutputs,
    writers: list[PartitionWriter],
    epoch: int,
) -> WriteResults:
    """Run every writer in one Spark job (built once per plan slot when the outputs come
    from one); nothing is committed before `finish`.

    A failed job is not run again here (one layer of retries per concern, docs/design.md):
    a newer run that took over fences this one; a writer's failure (its own retries spent)
    is a `TransientSinkError`, for the orchestrator's retry; any other failure, such as the
    job's own transform raising, is raised as it is."""
    spark = ctx.spark_or_none
    try:
        if out.slot is None:
            with out.bound(spark):
                return run_writers(out.frames, writers, out.measures(writers))
        plan = ctx.plans.writes.get(out.slot)
        if plan is None or not plan.fits(out.frames, writers):
            plan = WritersPlan(out.frames, writers, out.measures(writers))
            ctx.plans.writes[out.slot] = plan
        cache_kept = out.computed is not None and out.computed.cache_kept
        with out.bound(spark, plan, writers):
            return plan.run(writers, cache_kept=cache_kept)
    except Exception as exc:
        if ctx.exactly_once:
            ctx.ledger.check_epoch(epoch)
        failed = failed_writer(exc)
        if failed is None:
            raise
        # A server that is gone is named as such (after its retries), not as a write.
        ctx.ledger.ping("reach the server after a failed write")
        raise TransientSinkError(
            f"window {window.window_id}: writing its rows failed on an executor ({failed}); "
            f"nothing was committed. Run the job again."
        ) from None
