"""The ledger checks itself at start-up, once the run's epoch fences every older run.

Each ledger table can be lost on its own (dropped, truncated, a partial restore). What a run
relies on is checked here, and what cannot be checked is harmless:

- `windows` lost, `source_units` kept: units taken by windows that are neither planned nor
  held by any sink would never be planned again. Their index rows are removed, so their input
  is new again (windows a sink holds were put back from its records by `rebuild_ledger`).
- `source_units` lost: rebuilt from the windows' offsets (`JobContext.rebuild_ledger`).
- `dedupe_keys` lost, `dedupe_windows` kept: lookups would find no earlier key and let
  duplicates through. The index's window list is cleared, so every completed window is
  indexed again from the dedupe state sink before the next window is computed.
- `jobs` lost: a new epoch is taken above every epoch the sinks and the ledger's other tables
  recorded (`Ledger.epoch_floor`).
- `restatements` lost: new restatements are numbered above what the sinks applied
  (`SinkGroup.restated_through`).
- `sink_commits` lost: the PostgreSQL sinks lack completed windows, and every run refuses
  (`Engine.check_sinks_hold_completed`) naming `onceflow reconcile`.
- `abandoned_windows` lost: the gaps are lacking windows again wherever the sink says it
  lacks them (`SinkGroup.held`), and runs refuse the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import psycopg

from onceflow._ledger_scan import orphaned_windows
from onceflow.errors import LedgerError

if TYPE_CHECKING:
    from onceflow._keyindex import KeyIndex
    from onceflow._ledger_verified import Verified
    from onceflow.job import Job
    from onceflow.ledger import Ledger


class JobContext(Protocol):
    """What the check uses of `onceflow.window.context.JobContext` (which runs it at start-up,
    so the type is stated here rather than imported)."""

    job: Job
    ledger: Ledger
    index: KeyIndex | None

    def held(self, window_ids: Sequence[int]) -> dict[int, set[str]]: ...

    def rebuild_ledger(self, verified: Verified | None = None) -> list[int]: ...


_log = logging.getLogger(__name__)


def check_ledger(engine: JobContext, epoch: int, verified: Verified | None = None) -> None:
    """Repair what the ledger can tell it lost (see the module); `epoch` is the run's own,
    already claimed in every sink, so no older run commits anything from here on. With
    `verified`, only what changed since the verified point is looked at
    (`onceflow._ledger_verified`)."""
    _release_lost_windows_input(engine, epoch, verified)
    _check_key_index(engine, epoch)


def _release_lost_windows_input(engine: JobContext, epoch: int, verified: Verified | None) -> None:
    from onceflow.windows import format_windows

    ledger, job = engine.ledger, engine.job.name
    lost = orphaned_windows(ledger, verified)
    if not lost:
        return
    # A run fenced only now may have committed one of them after the ledger was rebuilt.
    held = sorted(wid for wid, sinks in engine.held(lost).items() if sinks)
    if held:
        engine.rebuild_ledger()
        still = set(held) & set(orphaned_windows(ledger))
        if still:
            raise LedgerError(
                f"job {job}: windows {format_windows(sorted(still))} are missing from the "
                "ledger's plan (onceflow.windows), their input is marked taken, and a sink "
                "holds them without a record of that input (its commit log was cleaned). "
                "Nothing was computed. Restore onceflow.windows from a backup of the ledger "
                f"database, then run `onceflow reconcile {job}`."
            )
        lost = [wid for wid in lost if wid not in held]
    if not lost:
        return
    released = ledger.release_units(epoch, lost)
    _log.warning(
        "job %s: windows %s were lost from the ledger's plan and no sink holds them; their "
        "%d input unit(s) will be planned again as new windows",
        job,
        format_windows(lost),
        released,
    )


def _check_key_index(engine: JobContext, epoch: int) -> None:
    if engine.index is None:
        return
    ledger, job = engine.ledger, engine.job.name
    row = ledger.read(
        "check the dedupe key index",
        lambda conn: conn.execute(
            "SELECT EXISTS (SELECT 1 FROM onceflow.dedupe_windows WHERE job = %(job)s"
            "               AND keys > 0)"
            " AND NOT EXISTS (SELECT 1 FROM onceflow.dedupe_keys WHERE job = %(job)s)",
            {"job": job},
        ).fetchone(),
    )
    if not (row and row[0]):
        return

    def forget(conn: psycopg.Connection) -> None:
        ledger.fence(conn, epoch)
        conn.execute("DELETE FROM onceflow.dedupe_windows WHERE job = %s", (job,))

    ledger.write("forget the windows of a lost key index", forget, epoch)
    _log.warning(
        "job %s: the dedupe key index lost its keys; every completed window is indexed again "
        "from the dedupe state sink before the next window",
        job,
    )
