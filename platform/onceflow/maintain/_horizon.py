"""What still needs a Delta table's old versions: the horizon vacuum and log cleanup stop at.

A downstream job (one whose source is a `DeltaTableSource` on the table) reads each version's
added and removed files, and the snapshot just before its window, so it needs every file live
at version `start - 1` or later, where `start` is the first version of the oldest window it may
still read: the next version after its last planned window, the first version of a pending
window (a replay reads it again), and of a window with an unfinished restatement. The ledger
knows all three; nothing here asks the downstream job's sinks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onceflow.job import Job
from onceflow.ledger import Ledger
from onceflow.settings import Settings
from onceflow.sinks.maintenance import Hold
from onceflow.sources.delta import DeltaTableSource
from onceflow.storage import Location


def readers(table: Location, jobs: Iterable[Job], settings: Settings) -> list[Job]:
    """The jobs whose source reads the Delta table at `table`."""
    found = []
    for job in jobs:
        source = job.source
        if isinstance(source, DeltaTableSource):
            if Location.parse(source.root(settings)).uri == table.uri:
                found.append(job)
    return found


def downstream_holds(
    dsn: str, table: Location, jobs: Sequence[Job], settings: Settings
) -> list[Hold]:
    """Each downstream job's oldest needed version of the table (one hold per job)."""
    holds = []
    for job in readers(table, jobs, settings):
        holds.append(_job_hold(Ledger(dsn, job.name), job.name))
    return holds


def _job_hold(ledger: Ledger, job: str) -> Hold:
    last = ledger.last_offsets()
    if last is None or last.get("end") is None:
        return Hold(job, -1, "has read nothing yet (it starts at version 0)")
    start, reason = int(last["end"]) + 1, f"has read through version {int(last['end'])}"
    pending = ledger.windows(pending_only=True)
    for window in pending:
        if int(window.offsets["start"]) < start:
            start = int(window.offsets["start"])
            reason = f"has pending window {window.window_id} from version {start}"
    for _seq, window_id, request in ledger.pending_restatements():
        window = ledger.window(window_id)
        if window is not None and int(window.offsets["start"]) < start:
            start = int(window.offsets["start"])
            reason = (
                f"has an unfinished restatement ({request}) of window {window_id} from "
                f"version {start}"
            )
    return Hold(job, start - 1, reason)
