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
) -> list[WindowResult]:
    """Recompute `window_ids` with the job's current transform and replace their effect.

    Args:
        engine: The job's engine.
        window_ids: Windows committed in every sink.
        request_id: Identifies the request; retries of one request restate each window once.
            Defaults to a new id (a new request).
        run_id: This run's id, recorded with the commits.

    Raises:
        ConfigurationError: A window was never planned.
        SinkError: A sink cannot restate a window (checked before anything changes).
    """
    run_id = run_id or uuid.uuid4().hex
    request_id = request_id or run_id
    epoch = engine.start(run_id)
    engine.check_sinks_hold_completed()
    ledger = engine.ledger
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
