"""Compute: a window's outputs and stats, the same rows for every sink and every retry."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from onceflow import _window_params as window_params
from onceflow._compute import Computed, compute
from onceflow._identifiers import spark_sql_name
from onceflow._keyindex import Basis, StagedKeys
from onceflow._keylookup import KEY_COL
from onceflow._plan_reruns import jobs_started
from onceflow._staging import WindowStage
from onceflow.errors import ConfigurationError
from onceflow.ledger import Window
from onceflow.sources.base import ArrowParse
from onceflow.window.context import JobContext
from onceflow.window.keys import ensure_index
from onceflow.window.outputs import KEYS_OUTPUT, WindowOutputs
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_log = logging.getLogger(__name__)

# Where a stage's completion marker keeps the basis of its window's dedupe (`Basis.to_json`).
_BASIS = "basis"


def outputs(
    ctx: JobContext,
    window: Window,
    *,
    stage: WindowStage | None = None,
    stage_tag: str = "",
    seen_also: Sequence[StagedKeys] = (),
    planned: bool = False,
    epoch: int | None = None,
) -> WindowOutputs:
    """The window's outputs and stats, the same rows for every sink and every retry.

    A deterministic job computes them again on a replay, from cached intermediates within
    a run; any other job stages them once (Parquet under the lake, in `stage`, or the
    window's stage tagged `stage_tag`) and reuses the stage while what its dedupe saw
    (`WindowOutputs.basis`, kept in the stage's marker) is still every earlier window the
    ledger plans and did not skip. `seen_also`: staged keys of earlier windows not in the key
    index yet, which its lookups read too. `planned`: the outputs may come from a plan made
    for any window of the run (then their Spark jobs run inside `WindowOutputs.bound`, and
    their lookups with them).
    """
    job = ctx.job
    state = ensure_index(ctx, window.window_id, epoch)
    # What the lookups will see: the index as it is now, and `seen_also` once found whole.
    basis = state.indexed if ctx.tracks_basis and state is not None else None
    looked_up = tuple(seen_also) if basis is not None else ()
    names = sorted({s.output for s in job.sinks})
    if planned and job.deterministic:
        out = _planned_outputs(ctx, window, names, seen_also)
        if out is not None:
            out.basis, out.looked_up = basis, looked_up
            return out
    if not job.deterministic:
        stage = stage or ctx.stage(window, stage_tag)
        staged_names = [*names, KEYS_OUTPUT] if ctx.index is not None else names
        stats = stage.complete()
        if stats is not None:
            recorded = stats.pop(_BASIS, None)
            was = Basis.from_json(recorded) if recorded is not None else None
            if basis is not None and state is not None and (was is None or was != state.due):
                _log.warning(
                    "window %d: its stage was deduplicated against %s, but the ledger now "
                    "plans %s before it; computing it again",
                    window.window_id,
                    was if was is not None else "unrecorded windows",
                    state.due,
                )
            elif stage.intact(stats, staged_names):
                return WindowOutputs(
                    {name: stage.read(ctx.spark, name) for name in staged_names},
                    stats,
                    basis=was,
                )
            else:
                _log.warning("window %d: its stage lost rows; computing it again", window.window_id)
            stage.clear()
    else:
        stage = None
    index, dedupe = ctx.index, job.dedupe
    computed = compute(
        ctx.spark,
        job,
        ctx.settings,
        [window],
        lookup=(
            index.lookup(dedupe.key, window.window_id, [s.table for s in seen_also])
            if index is not None and dedupe is not None
            else None
        ),
        window_column=False,
    )
    frames = _frames(ctx, computed, names)
    out = WindowOutputs(
        frames,
        None,
        computed,
        quarantine=job.quarantine_sink is not None,
        basis=basis,
        looked_up=looked_up,
    )
    if stage is None:
        return out
    try:
        stats = out.count()
        staged = {name: stage.write(name, frames[name]) for name in frames}
        stats["outputs"] = {name: stage.rows(name) for name in frames}
        confirm(ctx, out)  # every lookup ran in the jobs above
        marker = stats if out.basis is None else {**stats, _BASIS: out.basis.to_json()}
        stage.finish(marker)
    except Exception:
        # Outputs of code that raised are never kept, in part or whole: the window is
        # computed afresh, with the code as it is then.
        _clear_quietly(stage)
        raise
    finally:
        out.release()
    return WindowOutputs(staged, stats, basis=out.basis)


def confirm(ctx: JobContext, out: WindowOutputs) -> None:
    """Count in `out`'s basis the staged keys its lookups read, if still whole (the lookups
    are done: they ran in the jobs that wrote the window's staged copies)."""
    if ctx.index is not None and out.basis is not None and out.looked_up:
        out.basis = ctx.index.confirm(out.basis, out.looked_up)
    out.looked_up = ()


def _frames(ctx: JobContext, computed: Computed, names: Sequence[str]) -> dict[str, DataFrame]:
    """The sinks' frames of a computation (and the key index's)."""
    frames = {
        name: df.drop(WINDOW_COL) if WINDOW_COL in df.columns else df
        for name, df in computed.outputs.items()
        if name in names
    }
    dedupe = ctx.job.dedupe
    if dedupe is not None:
        state = ctx.job.sink(dedupe.state_sink)
        if "_window_id" not in frames[state.output].columns:
            computed.forget()
            raise ConfigurationError(
                f"sink {state.name} holds the job's dedupe state, but its rows have no "
                "`_window_id` column; add it in the transform (the window's id, from ctx)."
            )
    if ctx.index is not None:
        frames[KEYS_OUTPUT] = computed.kept.where(
            f"{spark_sql_name(KEY_COL)} IS NOT NULL"
        ).selectExpr(spark_sql_name(KEY_COL), f"{spark_sql_name(WINDOW_COL)} AS window_id")
    return frames


def _planned_outputs(
    ctx: JobContext, window: Window, names: Sequence[str], seen_also: Sequence[StagedKeys]
) -> WindowOutputs | None:
    """The window's outputs from the plan of its slot (made now if the slot has none), or
    None if the job's plan does not hold for any window, or the source cannot read this
    window with it.

    Windows alternate between two slots, so the window committing and the one being
    prepared never share a plan: Spark takes cached rows for any equal plan. A slot's
    window releases its cached rows when it is committed or dropped, before the slot's
    next window is prepared."""
    job, index, dedupe, spark = ctx.job, ctx.index, ctx.job.dedupe, ctx.spark_or_none
    planned = ctx.plans.outputs
    if (
        planned is None
        or not isinstance(job.parse, ArrowParse)
        or (dedupe is not None and not job.parse.keeps_order)
        or spark is None
        or not window_params.supported(spark)
    ):
        return None
    read = job.source.window_read(spark, ctx.settings, window.offsets)
    if read is None:
        return None
    slot = ctx.plans.slot_base + window.window_id % 2
    staged = [s.table for s in seen_also]
    params = {"read": read, "window_id": window.window_id, "staged": staged}
    quarantine = job.quarantine_sink is not None
    plan = planned.get(slot)
    if plan is not None:
        assert plan.computed is not None
        if plan.computed.cached:  # its last window is not released: plan this one alone
            return None
        plan.computed.persist()
        return WindowOutputs(dict(plan.frames), None, plan.computed, quarantine, params, slot)
    # A transform may run Spark jobs while planning (a count, a collect): they read this
    # window's rows, and what they found holds for this window only.
    with window_params.bound(spark, params), jobs_started(spark) as started:
        computed = compute(
            spark,
            job,
            ctx.settings,
            [window],
            lookup=(
                index.lookup(dedupe.key, window.window_id)
                if index is not None and dedupe is not None
                else None
            ),
            window_column=False,
            slot=slot,
        )
    if not computed.any_window or started():
        computed.release()
        ctx.plans.outputs = None
        _log.info("job %s: its windows are planned one by one", job.name)
        return None
    frames = _frames(ctx, computed, names)
    out = WindowOutputs(frames, None, computed, quarantine, params, slot)
    planned[slot] = WindowOutputs(dict(frames), None, computed, quarantine)
    return out


def _clear_quietly(stage: WindowStage) -> None:
    try:
        stage.clear()
    except Exception:  # a stage without its marker is never read; the next attempt clears it
        _log.warning("window %d: could not remove its unfinished stage", stage.window_id)
