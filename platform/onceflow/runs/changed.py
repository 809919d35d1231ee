"""Input of completed windows that changed after they committed: never delivered, so named."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from onceflow._ledger_scan import windows_of_units
from onceflow.sources.base import ChangedUnit, Source

if TYPE_CHECKING:
    from onceflow.ledger import Window
    from onceflow.window.context import JobContext

_log = logging.getLogger(__name__)


# How many changed files a message names (the status JSON lists them all).
NAMED_CHANGES = 3


def changed_input(engine: JobContext, windows: Sequence[Window] | None = None) -> list[ChangedUnit]:
    """Input of completed windows that changed after they committed (size or modification
    time differs from the window's offsets): the job never reads it again, so its new
    content is not delivered. Files that are gone are not listed."""
    if windows is None:
        source = engine.job.source
        if type(source).changed_after_commit is Source.changed_after_commit:
            return []  # a kind whose input cannot change after it committed
        # Only input still visible can be reported: the windows that took it, not every
        # window ever (a producer that cleans up committed input keeps this small).
        units = source.discover(engine.settings, None)
        every: Sequence[Window] = windows_of_units(engine.ledger, units)
    else:
        every = windows
    committed = {w.window_id: w.offsets for w in every if w.completed and w.skipped is None}
    return engine.job.source.changed_after_commit(engine.settings, committed)


def changed_input_message(job: str, changed: Sequence[ChangedUnit]) -> str:
    """What a warning about `changed` says: which files, and what to do."""
    named = "; ".join(c.describe() for c in changed[:NAMED_CHANGES])
    more = f" and {len(changed) - NAMED_CHANGES} more" if len(changed) > NAMED_CHANGES else ""
    return (
        f"job {job}: {len(changed)} input file(s) changed after their window committed: "
        f"{named}{more}. onceflow reads each file once, so the change is not delivered. Land "
        "added records in a new file; restore the changed file (or remove it: a removed "
        f"committed file is not reported). `onceflow status {job} --json` lists them all."
    )


def warn_changed_input(engine: JobContext) -> list[ChangedUnit]:
    """Log a warning when committed input changed (at the start of a run)."""
    changed = changed_input(engine)
    if changed:
        _log.warning("%s", changed_input_message(engine.job.name, changed))
    return changed
