"""Complete: a committed window marked completed, its staged dedupe keys into the key index."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import Any

import psycopg

from onceflow._pgcopy import CopyWriter
from onceflow.sinks.contract import SinkOutcome
from onceflow.sinks.writers import rows_written
from onceflow.window.context import JobContext

_log = logging.getLogger(__name__)


def complete(
    ctx: JobContext,
    window_id: int,
    keys: CopyWriter | None,
    results: Mapping[str, list[dict[str, Any]]],
    commits: Sequence[SinkOutcome] = (),
    completing: Completing | None = None,
) -> bool:
    """Mark the window completed, moving its staged dedupe keys into the key index in the
    same transaction (and recording the sink `commits` that wrote it, for lineage); False
    if the keys were lost (the next window indexes them from the state sink). `completing`:
    the keys' move begun beside the sinks' commits, finished here if it can be."""
    index = ctx.index
    if completing is not None:
        indexed = completing.finish(commits)
        if indexed is not None:
            if not indexed:
                _log.warning("window %d: its staged dedupe keys were lost", window_id)
            return indexed
    if keys is None or index is None or keys.key not in results:
        ctx.ledger.mark_completed(window_id, commits=commits)
        return index is None
    rows = rows_written(results[keys.key])
    indexed = ctx.ledger.mark_completed(
        window_id,
        also=lambda conn: index.add(conn, keys.table, [window_id], rows),
        commits=commits,
    )
    if not indexed:
        _log.warning("window %d: its staged dedupe keys were lost", window_id)
    return bool(indexed)


# Fewer keys than this move after the sinks' commits, as before: their move is short, and a
# session of its own would cost a small window more than it saves (measured at 20,000 rows).
EARLY_MIN_KEYS = 100_000


class Completing:
    """A window's staged dedupe keys moved into the key index while its sinks commit.

    Moving a large window's keys is the last long statement of its commit (a million keys:
    about 5 s), and it needs nothing the sinks' commits do. So it runs beside them, in a
    transaction of its own session; `finish` then marks the window completed in that same
    transaction, once every sink holds the window, and commits it. Nothing of it is visible
    before that COMMIT, so the key index still holds exactly the completed windows. If the
    transaction is lost on the way (the server restarted, a newer run ended the session, the
    COMMIT got no answer), `finish` says so and the caller completes the window as before:
    every step is idempotent.
    """

    def __init__(
        self, ctx: JobContext, window_id: int, epoch: int, keys: CopyWriter, rows: int
    ) -> None:
        self._ctx, self._window_id, self._epoch = ctx, window_id, epoch
        self._conn: psycopg.Connection | None = None
        self._indexed: bool | None = None
        self._failed = False
        self._thread = threading.Thread(
            target=self._index, args=(keys, rows), name=f"onceflow-keys-{window_id}", daemon=True
        )
        self._thread.start()

    def _index(self, keys: CopyWriter, rows: int) -> None:
        index = self._ctx.index
        assert index is not None
        try:
            # Named after the run's epoch: a newer run ends it like the run's other sessions.
            self._conn = self._ctx.ledger.connect(self._epoch)
            self._indexed = index.add(self._conn, keys.table, [self._window_id], rows)
        except Exception:  # the caller completes the window as before
            _log.debug("window %d: keys not indexed early", self._window_id, exc_info=True)
            self._failed = True

    def finish(self, commits: Sequence[SinkOutcome]) -> bool | None:
        """Mark the window completed with its keys; whether the keys were indexed (as
        `complete`), or None if the transaction was lost and nothing is known of it."""
        self._thread.join()
        conn = self._conn
        if self._failed or conn is None or self._indexed is None:
            self.abandon()
            return None
        try:
            self._ctx.ledger.mark_completed_in(conn, self._window_id, commits)
            conn.commit()
        except psycopg.Error:
            _log.info("window %d: completing it again", self._window_id, exc_info=True)
            self.abandon()
            return None
        self.abandon()  # committed: this only closes the session
        return self._indexed

    def abandon(self) -> None:
        """Roll the transaction back (closing its session), if it is still open."""
        self._thread.join()
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a session that is gone already
                _log.debug("window %d: closing", self._window_id, exc_info=True)
            self._conn = None


def begin_completing(
    ctx: JobContext,
    window_id: int,
    epoch: int,
    keys: CopyWriter | None,
    results: Mapping[str, list[dict[str, Any]]],
) -> Completing | None:
    """Start moving the window's staged keys into the index (`Completing`), if it has
    `EARLY_MIN_KEYS` or more."""
    if keys is None or ctx.index is None or keys.key not in results:
        return None
    rows = rows_written(results[keys.key])
    if rows < EARLY_MIN_KEYS:
        return None
    return Completing(ctx, window_id, epoch, keys, rows)


def add_records(
    ctx: JobContext, window_id: int, outcomes: MutableMapping[str, SinkOutcome]
) -> None:
    """For each sink that held the window before this run committed anything (an earlier run
    committed it and stopped before completing it), take the sink's own record of that commit
    into its outcome, so the ledger records it for lineage like a commit of this run."""
    held = {
        name
        for name, o in outcomes.items()
        if o.already_committed and o.data_version is None and o.commit_ref is None
    }
    for group in ctx.groups:
        if not held.intersection(group.names):
            continue
        for sink, records in group.commit_records([window_id]).items():
            record = records.get(window_id)
            if sink not in held or record is None:
                continue
            outcomes[sink] = replace(
                outcomes[sink],
                data_version=record.data_version,
                commit_ref=record.commit_ref,
                rows=record.rows or 0,
            )
