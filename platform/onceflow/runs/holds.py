"""What the sinks hold against what the ledger says they hold, and what a replay can restore."""

from __future__ import annotations

from collections.abc import Sequence

from onceflow._ledger_scan import windows_above
from onceflow.errors import LedgerError, SinkStateError
from onceflow.job import Guarantee
from onceflow.ledger import Window
from onceflow.window.context import JobContext
from onceflow.windows import format_windows


def lacking(ctx: JobContext, windows: Sequence[Window]) -> dict[str, list[int]]:
    """For each sink, the windows among `windows` the ledger marks completed that it does not
    hold (a window abandoned for a sink is a known gap there, not a lacking window)."""
    completed = [w.window_id for w in windows if w.completed]
    state = ctx.held(completed)
    abandoned = ctx.ledger.abandoned()
    out: dict[str, list[int]] = {}
    for wid in completed:
        for name in ctx.sink_names:
            if name not in state[wid] and wid not in abandoned.get(name, ()):
                out.setdefault(name, []).append(wid)
    return out


def completed_unverified(ctx: JobContext) -> list[Window]:
    """The completed windows above the sinks' held floor: the only ones a sink can lack (a
    table lost or restored from an older copy lowers the floor, so they are read again)."""
    return windows_above(ctx.ledger, ctx.held_floor(), completed_only=True)


def replay_problems(ctx: JobContext, window: Window) -> list[str]:
    """What keeps `window` from being computed again (its input gone or changed, and no
    complete stage of it); empty when it can be replayed."""
    problems = ctx.job.source.check_available(ctx.settings, window.offsets)
    if problems and ctx.stage(window).complete() is not None:
        return []
    return problems


def check_sinks_hold_completed(ctx: JobContext) -> None:
    """Refuse to compute anything while a sink lacks windows the ledger says it holds.

    Without this, a lost dedupe state lets duplicates of earlier records through, and the
    next windows would be committed on top of a hole that no later run fills.
    """
    job = ctx.job
    if job.guarantee is Guarantee.NONE:
        return
    with ctx.pinned():
        windows = completed_unverified(ctx)
        through = max((w.window_id for w in windows), default=0)
        # Taken before the check: a record removed after it changes what the next one finds.
        marks = [(group, group.held_mark(through)) for group in ctx.groups] if through else []
        lacks = lacking(ctx, windows)
        problems = {k: v for group in ctx.groups for k, v in group.state_problems().items()}
    if not lacks and not problems:
        for group, mark in marks:
            group.record_held(through, mark)
        return
    which = "; ".join(
        [f"{name} lacks windows {format_windows(ids)}" for name, ids in lacks.items()]
        + [f"{name} {problem}" for name, problem in problems.items()]
    )
    ids = {wid for wids in lacks.values() for wid in wids}
    # No lacking window when only `problems` were found (a restatement lost, say).
    windows = (
        [w for w in windows_above(ctx.ledger, min(ids) - 1) if w.window_id in ids] if ids else []
    )
    gone = [w.window_id for w in windows if replay_problems(ctx, w)]
    lost = (
        f" The input of windows {format_windows(gone)} is gone: no replay can bring them "
        f"back; after reconcile, `onceflow windows abandon {job.name} "
        f'{format_windows(gone)} --reason "…"` records the gap and lets runs go on.'
        if gone
        else ""
    )
    message = (
        f"job {job.name}: {which}, which the ledger records as committed (was the lake "
        "deleted, moved, or restored from an older copy?). Nothing was computed. Run "
        f"`onceflow reconcile {job.name}`: it replays the windows those sinks lack and "
        f"restores their commit records; then run the job again.{lost}"
    )
    # Recovery (reconcile) repairs a sink whose windows can be replayed; windows whose input
    # is gone need the operator's word first (`windows abandon`).
    raise (LedgerError if gone else SinkStateError)(message)


def incomplete_windows(ctx: JobContext, windows: Sequence[Window]) -> dict[int, list[str]]:
    """Windows some sink does not hold, with the sinks that lack them (skipped windows, and
    windows abandoned for a sink, are not incomplete: the operator gave them up)."""
    every = set(ctx.sink_names)
    state = ctx.held([w.window_id for w in windows if w.skipped is None])
    abandoned = ctx.ledger.abandoned()
    incomplete: dict[int, list[str]] = {}
    for wid, held in state.items():
        lacks = sorted(n for n in every - held if wid not in abandoned.get(n, ()))
        if lacks:
            incomplete[wid] = lacks
    return incomplete
