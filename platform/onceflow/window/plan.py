"""Plan: new windows cut from input no window has taken, written ahead to the ledger."""

from __future__ import annotations

from collections.abc import Iterator

from onceflow.job import Guarantee
from onceflow.ledger import Window
from onceflow.window.context import JobContext

# Most units (files, table versions) a new window takes unless the run says otherwise.
DEFAULT_MAX_UNITS_PER_WINDOW = 1000


def unplanned_units(ctx: JobContext) -> list[str]:
    """Visible input no window has taken yet, in source order."""
    source = ctx.job.source
    return ctx.ledger.unplanned(source.discover(ctx.settings, ctx.ledger.last_offsets()))


class LedgerChangedUnderRun(Exception):
    """Rows of the ledger were removed since the run's start-up: nothing was planned, and
    the run checks the ledger again (`JobContext.start`) before it plans."""


def plan(ctx: JobContext, epoch: int, max_units: int | None) -> Iterator[Window]:
    """Plan windows over unplanned input, yielding each as soon as it is planned.

    Raises:
        LedgerChangedUnderRun: Before planning anything, when rows of the ledger were removed
            since start-up: the unit index may have lost input it took, which would look new.
    """
    units = unplanned_units(ctx)
    if units and ctx.ledger_changed():
        raise LedgerChangedUnderRun
    size = max_units or DEFAULT_MAX_UNITS_PER_WINDOW
    for start in range(0, len(units), size):
        chunk = units[start : start + size]
        offsets = ctx.job.source.offsets(ctx.settings, chunk)
        window = ctx.ledger.plan_window(epoch, offsets, chunk)
        if ctx.job.guarantee is Guarantee.NONE:
            ctx.ledger.mark_completed(window.window_id)
        yield window
