"""Restatement: replace chosen windows' effect in every sink with the job's current transform.

Each window of a request is planned in the ledger first under its own request id
(`<request>/w<window>`), so a retry of the request (even with a new run id) gets the same
sequence numbers and applies each window once. Every check runs before anything is recorded:
a refused request leaves no restatement behind for the next run to trip over. Then each sink
group replaces the window: a Delta table in one commit that removes the window's rows and adds
the new ones; the PostgreSQL sinks in one transaction (keyed tables lose the window's rows and
get the new ones; accumulating tables get the new contribution minus the recorded old one).

An unfinished restatement (cut short by a crash, or planned before a sink changed so that it
can no longer apply) is cancelled by request (`cancel_restatements`): recorded with a reason,
fenced by a new epoch, refused where a sink already applied it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from onceflow._staging import WindowStage
from onceflow.errors import ConfigurationError, SinkError
from onceflow.runs.restate import check_unfinished, request_of
from onceflow.window.results import WindowResult

if TYPE_CHECKING:
    from onceflow.engine import Engine
    from onceflow.ledger import Restatement, Window

# Said by every refusal made before anything was recorded.
NOTHING_RECORDED = "Nothing was recorded; the job runs on as before."


def restate_windows(
    engine: Engine,
    window_ids: Sequence[int],
    *,
    request_id: str | None = None,
    run_id: str | None = None,
    source_replaced: bool = False,
) -> list[WindowResult]:
    """Recompute `window_ids` with the job's current transform and replace their effect.

    Args:
        engine: The job's engine.
        window_ids: Windows committed in every sink.
        request_id: Identifies the request; retries of one request restate each window once.
            Defaults to a new id (a new request).
        run_id: This run's id, recorded with the commits.
        source_replaced: The source's input was replaced under the windows (an upstream Delta
            table recreated or restored from an older copy): every window of `window_ids` (all
            the job's windows if empty) whose input changed is pointed at the input as it is
            now (`Source.rebased`) and restated from it; the others are left alone.

    Raises:
        ConfigurationError: A window was never planned, or was skipped (nothing recorded).
        SinkError: A sink cannot restate a window, or an unfinished earlier restatement cannot
            be applied (checked before anything is recorded).
        SourceError: The replaced input cannot be read for a window (yet).
    """
    run_id = run_id or uuid.uuid4().hex
    request_id = request_id or run_id
    # Every check first, on what the ledger and the sinks hold now; only then an epoch (which
    # fences a running job) and the plan.
    engine.prepare()
    engine.rebuild_ledger()
    engine.check_retention()
    engine.check_sinks_hold_completed()
    rebased: dict[int, dict] = {}
    if source_replaced:
        rebased = _rebased(engine, window_ids)
        window_ids = [
            w.window_id for w in engine.ledger.windows() if w.completed and w.window_id in rebased
        ]
    windows = _restatable(engine, window_ids)
    check_unfinished(engine, engine.planned_restatements())
    epoch = engine.start(run_id)
    ledger = engine.ledger
    # Numbered above what any sink applied: the ledger's restatements may have been lost.
    floor = max((group.restated_through() for group in engine.groups), default=0)
    pending = [
        (
            window,
            ledger.plan_restatement(
                epoch, window.window_id, f"{request_id}/w{window.window_id}", floor
            ),
        )
        for window in windows
    ]
    # Re-pointed only once every sink can restate them and their restatements are written
    # ahead: a restatement cut short is finished by the next run, from the new offsets
    # (pending windows are replayed from them).
    for window in windows if rebased else ():
        for group in engine.groups:
            group.check_restate(window)
    for wid, offsets in sorted(rebased.items()):
        ledger.rebase_window(epoch, wid, offsets)
    # Every unfinished restatement, older requests' first: a Delta table records only the
    # highest sequence number it applied, so they must be applied in order.
    todo = engine.planned_restatements()
    ours = {seq for _, seq in pending}
    applying = {w.window_id for w, seq in todo if seq in ours}
    results = [
        WindowResult(w.window_id, w.offsets, w.stats or {})
        for w, _ in pending
        if w.window_id not in applying
    ]
    results += engine.restate(todo, epoch, run_id)
    results.sort(key=lambda r: r.window_id)
    return results


def _rebased(engine: Engine, window_ids: Sequence[int]) -> dict[int, dict]:
    """The new offsets of the windows whose input was replaced under them (all the job's
    windows if `window_ids` is empty), after checking each can be restated or replayed;
    pending and skipped windows are only re-pointed.

    Raises:
        ConfigurationError: The job deduplicates (its key index would keep first occurrences
            from the old input), or a window is held by some sinks only.
    """
    job = engine.job
    if job.dedupe is not None:
        raise ConfigurationError(
            f"job {job.name}: it deduplicates, and its key index holds first occurrences read "
            "from the replaced input, which a restatement does not change; start the job over "
            "instead (empty its sinks, drop its windows). Nothing was restated."
        )
    wanted = set(window_ids)
    # Skipped windows too (re-pointed only: they have no effect): planning reads on after the
    # newest window, skipped or not.
    windows = [w for w in engine.ledger.windows() if not wanted or w.window_id in wanted]
    rebased = {
        w.window_id: offsets
        for w in windows
        if (offsets := job.source.rebased(engine.settings, w.offsets)) is not None
    }
    pending = [w.window_id for w in windows if w.window_id in rebased and not w.completed]
    partly = {wid: sorted(sinks) for wid, sinks in engine.held(pending).items() if sinks}
    if partly:
        which = "; ".join(f"window {w} is held by {', '.join(s)}" for w, s in partly.items())
        raise ConfigurationError(
            f"job {job.name}: {which} only, so it can be neither replayed from the new input "
            "(the sinks would disagree) nor restated; restore the table it was read from and "
            "run the job to finish it, then restate, or start the job over. Nothing was "
            "restated."
        )
    return rebased


def _restatable(engine: Engine, window_ids: Sequence[int]) -> list[Window]:
    """The windows, if every sink can restate each of them; else the reason, by window."""
    job = engine.job.name
    windows: list[Window] = []
    for wid in sorted(set(window_ids)):
        window = engine.ledger.window(wid)
        if window is None:
            last = engine.ledger.last_window_id()
            raise ConfigurationError(
                f"job {job}: window {wid} was never planned (the last planned window is "
                f"{last}). {NOTHING_RECORDED}"
            )
        if window.skipped is not None:
            raise ConfigurationError(
                f"job {job}: window {wid} was skipped ({window.skipped}); it has no effect to "
                f"restate. {NOTHING_RECORDED}"
            )
        windows.append(window)
    for window in windows:
        for group in engine.groups:
            try:
                group.check_restate(window)
            except SinkError as exc:
                raise SinkError(f"job {job}: {exc.message} {NOTHING_RECORDED}") from None
    return windows


@dataclass
class Cancelled:
    """What `cancel_restatements` did.

    Attributes:
        request: The request.
        cancelled: Restatements cancelled now (or by an earlier cancel of the same request).
        finished: Restatements of the request that had finished: they stay.
        reason: The recorded reason.
    """

    request: str
    reason: str
    cancelled: list[Restatement] = field(default_factory=list)
    finished: list[Restatement] = field(default_factory=list)


def cancel_restatements(
    engine: Engine, request: str, *, reason: str = "", run_id: str | None = None
) -> Cancelled:
    """Give up the unfinished restatements of `request` (its windows keep the rows they have).

    `request` is what `onceflow status` lists (the request, or one window's `<request>/w<N>`).
    Takes a new epoch, so a run applying them is fenced, and checks again under it; a
    restatement some sink already applied is refused (the sinks would disagree for good: the
    next run finishes it instead). Cancelling a cancelled request again changes nothing.

    Raises:
        ConfigurationError: No such request, it is finished, or a sink applied part of it
            (nothing recorded).
    """
    job = engine.job.name
    reason = reason.strip() or "cancelled by an operator"
    engine.prepare()
    found = engine.ledger.restatements(request)
    if not found:
        raise ConfigurationError(
            f"job {job}: there is no restatement request {request!r}. `onceflow status {job}` "
            f"lists the unfinished ones with their requests. {NOTHING_RECORDED}"
        )
    finished = [r for r in found if r.completed]
    earlier = [r for r in found if r.cancelled is not None]
    unfinished = [r for r in found if not r.completed and r.cancelled is None]
    if not unfinished:
        if earlier:
            return Cancelled(request, earlier[0].cancelled or reason, earlier, finished)
        raise ConfigurationError(
            f"job {job}: restatement request {request!r} is finished (every window was "
            "restated in every sink); a finished restatement cannot be cancelled. Restate the "
            f"windows again with the code you want. {NOTHING_RECORDED}"
        )
    _refuse_applied(engine, unfinished)
    epoch = engine.start(run_id or f"cancel-{uuid.uuid4().hex}")
    # Again under the new epoch: a run that applied one before it was fenced is seen now.
    unfinished = [
        r for r in engine.ledger.restatements(request) if not r.completed and r.cancelled is None
    ]
    _refuse_applied(engine, unfinished)
    for item in unfinished:
        engine.ledger.cancel_restatement(epoch, item.seq, reason)
        window = engine.ledger.window(item.window_id)
        if window is not None:  # its recomputed output, if staged, is never needed now
            WindowStage(
                engine.settings.lake, job, item.window_id, window.offsets, f"-r{item.seq}"
            ).discard()
    after = engine.ledger.restatements(request)
    return Cancelled(request, reason, [r for r in after if r.cancelled is not None], finished)


def _refuse_applied(engine: Engine, unfinished: Sequence[Restatement]) -> None:
    job = engine.job.name
    for item in unfinished:
        applied = sorted(
            name for group in engine.groups for name in group.restatement_applied(item.seq)
        )
        if applied:
            raise ConfigurationError(
                f"job {job}: the restatement of window {item.window_id} (seq {item.seq}, "
                f"request {request_of(item.request_id)}) is already applied in "
                f"{', '.join(applied)}; cancelling it would leave the sinks apart for good. "
                f"`onceflow run {job}` finishes it. {NOTHING_RECORDED}"
            )
