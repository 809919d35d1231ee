"""Skip: pending windows whose input is gone or changed, given up with the operator's reason."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from onceflow.errors import ConfigurationError
from onceflow.ledger import Window
from onceflow.window.context import JobContext
from onceflow.windows import format_windows

_log = logging.getLogger(__name__)


def skip(
    ctx: JobContext, window_ids: Sequence[int], reason: str, run_id: str | None = None
) -> list[int]:
    """Give up pending windows whose input is gone or changed, recording why.

    Checks first (a refusal records nothing, not even an epoch), then takes a new epoch, so
    a run working on the windows is fenced, and checks again under it. A window some sink
    already holds cannot be skipped: the sinks would disagree for good; its staged output or
    its input is needed to finish it.

    Raises:
        ConfigurationError: No reason, a window never planned, completed, or partly held.
    """
    if not reason.strip():
        raise ConfigurationError("say why the windows are skipped (--reason); it is recorded.")
    # Checked before the epoch (which fences a running job) and again under it.
    ctx.prepare()
    ctx.rebuild_ledger()
    _skippable(ctx, window_ids)
    epoch = ctx.start(run_id or f"skip-{uuid.uuid4().hex}")
    windows = _skippable(ctx, window_ids)
    for window in windows:
        if window.skipped is None:
            ctx.ledger.skip_window(epoch, window.window_id, reason.strip())
            ctx.stage(window).discard()
    _log.warning(
        "job %s: windows %s skipped: %s",
        ctx.job.name,
        format_windows([w.window_id for w in windows]),
        reason,
    )
    return [w.window_id for w in windows]


def _skippable(ctx: JobContext, window_ids: Sequence[int]) -> list[Window]:
    job = ctx.job.name
    windows = []
    for wid in sorted(set(window_ids)):
        window = ctx.ledger.window(wid)
        if window is None:
            raise ConfigurationError(
                f"job {job}: window {wid} was never planned; nothing was recorded."
            )
        if window.completed:
            raise ConfigurationError(
                f"job {job}: window {wid} is committed in every sink; only "
                "pending windows can be skipped (use restate to change a committed one). "
                "Nothing was recorded."
            )
        windows.append(window)
    held = ctx.held([w.window_id for w in windows if w.skipped is None])
    partly = {wid: sorted(names) for wid, names in held.items() if names}
    if partly:
        which = "; ".join(f"window {w} is held by {', '.join(n)}" for w, n in partly.items())
        raise ConfigurationError(
            f"job {job}: {which}. Skipping would leave the sinks apart for "
            "good; restore the window's input and run the job to finish it instead. "
            "Nothing was recorded."
        )
    return windows
