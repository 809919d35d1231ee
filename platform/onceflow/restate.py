"""Restatement: replace chosen windows' effect in every sink with the job's current transform.

Each window of a request is planned in the ledger first under its own request id
(`<request>/w<window>`), so a retry of the request (even with a new run id) gets the same
sequence numbers and applies each window once. Every check runs before the first sink changes.
Then each sink group replaces the window: a Delta table in one commit that removes the window's
rows and adds the new ones; the PostgreSQL sinks in one transaction (keyed tables lose the
window's rows and get the new ones; accumulating tables get the new contribution minus the
recorded old one).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from onceflow.engine import WindowResult
from onceflow.errors import ConfigurationError

if TYPE_CHECKING:
    from onceflow.engine import Engine
    from onceflow.ledger import Window


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
        ConfigurationError: A window was never planned.
        SinkError: A sink cannot restate a window (checked before anything changes).
        SourceError: The replaced input cannot be read for a window (yet).
    """
    run_id = run_id or uuid.uuid4().hex
    request_id = request_id or run_id
    epoch = engine.start(run_id)
    engine.check_sinks_hold_completed()
    ledger = engine.ledger
    rebased: dict[int, dict] = {}
    if source_replaced:
        rebased = _rebased(engine, window_ids)
        window_ids = [
            w.window_id for w in ledger.windows() if w.completed and w.window_id in rebased
        ]
    windows: list[Window] = []
    for wid in sorted(set(window_ids)):
        window = ledger.window(wid)
        if window is None:
            raise ConfigurationError(
                f"job {engine.job.name}: window {wid} was never planned; nothing was restated."
            )
        if window.skipped is not None:
            raise ConfigurationError(
                f"job {engine.job.name}: window {wid} was skipped ({window.skipped}); it has no "
                "effect to restate."
            )
        windows.append(window)
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
