"""Operator actions on a job's windows and restatements (no Spark): recompute, abandon, and
cancelling a restatement. Each checks everything before it records anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._results import AbandonResult, CancelResult, RecomputeResult, RestatementItem

if TYPE_CHECKING:
    from onceflow.ledger import Restatement
    from onceflow.settings import Settings


def recompute(
    job: JobRef,
    window_ids: Sequence[int],
    settings: Settings | None = None,
    *,
    dsn: str | None = None,
    run_id: str | None = None,
) -> RecomputeResult:
    """Have pending windows that no sink holds computed again with the job's current code by
    the next run: their stage is dropped, their input and place in the ledger kept.

    Raises:
        ConfigurationError: A window never planned, skipped, held by some sink, or whose input
            is gone (nothing changed).
    """
    from onceflow.runs.windows import recompute_windows

    engine = open_engine(job, settings, dsn=dsn)
    done = recompute_windows(engine, list(window_ids), run_id)
    return RecomputeResult(
        engine.job.name, tuple(done.windows), tuple(done.later), done.deterministic
    )


def abandon(
    job: JobRef,
    window_ids: Sequence[int],
    reason: str,
    settings: Settings | None = None,
    *,
    dsn: str | None = None,
    run_id: str | None = None,
) -> AbandonResult:
    """Give up completed windows a sink lacks and whose input is gone: a recorded, known gap.

    Raises:
        ConfigurationError: No reason; a window never planned, skipped, pending, held by every
            sink, or whose input is still readable (reconcile replays it then).
    """
    from onceflow.runs.windows import abandon_windows

    engine = open_engine(job, settings, dsn=dsn)
    done = abandon_windows(engine, list(window_ids), reason, run_id)
    return AbandonResult(
        engine.job.name,
        reason.strip(),
        {w: tuple(s) for w, s in done.windows.items()},
        {s: tuple(w) for s, w in done.lacking.items()},
    )


def cancel_restatement(
    job: JobRef,
    request: str,
    reason: str = "",
    settings: Settings | None = None,
    *,
    dsn: str | None = None,
    run_id: str | None = None,
) -> CancelResult:
    """Give up the unfinished restatements of `request` (as `status` lists it); their windows
    keep the rows they have. Cancelling a cancelled request again changes nothing.

    Raises:
        ConfigurationError: No such request, it is finished, or a sink applied part of it.
    """
    from onceflow.restate import cancel_restatements

    engine = open_engine(job, settings, dsn=dsn)
    done = cancel_restatements(engine, request, reason=reason, run_id=run_id)
    return CancelResult(
        engine.job.name,
        done.request,
        done.reason,
        tuple(_item(r) for r in done.cancelled),
        tuple(_item(r) for r in done.finished),
    )


def _item(restatement: Restatement) -> RestatementItem:
    return RestatementItem(restatement.window_id, restatement.seq, restatement.cancelled)
