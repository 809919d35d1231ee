"""The key index made to hold exactly the completed windows before a window, before it computes."""

from __future__ import annotations

import logging
from typing import Any

from onceflow._identifiers import session_name
from onceflow._keyindex import Basis, IndexState, spans
from onceflow._keylookup import key_frame
from onceflow.errors import LedgerError, SinkStateError, TransientSinkError
from onceflow.sinks.writers import rows_written, run_writers
from onceflow.window.context import JobContext
from onceflow.window.outputs import KEYS_OUTPUT
from onceflow.windows import format_windows

_log = logging.getLogger(__name__)


def ensure_index(ctx: JobContext, window_id: int, epoch: int | None = None) -> IndexState | None:
    """Make the key index hold exactly the completed windows before `window_id`: put in those
    it lacks, from the dedupe state sink (made before the index existed, or their staged keys
    were lost), and take out those the ledger does not mark completed (a ledger lost or
    changed). Return what the index and the ledger then hold; None if the job does not dedupe
    by the index."""
    job, dedupe, index = ctx.job, ctx.job.dedupe, ctx.index
    if dedupe is None or index is None:
        return None
    state = index.state(window_id)
    if state.stale:
        _log.warning(
            "job %s: the dedupe key index held %s, which the ledger does not mark "
            "completed; they are taken out of it",
            job.name,
            Basis(spans(state.stale)),
        )
        index.forget(state.stale)
        state = state.indexing((), state.stale)
    missing = state.missing
    if not missing:
        return state
    gap = sorted(set(missing) & ctx.ledger.abandoned().get(dedupe.state_sink, set()))
    if gap:
        raise LedgerError(
            f"job {job.name}: the dedupe key index lacks windows "
            f"{format_windows(missing)}, and windows {format_windows(gap)} were abandoned "
            f"for the dedupe state sink {dedupe.state_sink}: their keys cannot be indexed "
            "again, and later duplicates of their records would pass. Nothing was "
            "computed. Restore onceflow.dedupe_keys and onceflow.dedupe_windows from a "
            "backup of the ledger database."
        )
    group = ctx.group_of[dedupe.state_sink]
    through = group.committed_through()[dedupe.state_sink]
    if through < missing[-1] and _unskipped(ctx, through, missing[-1] + 1):
        raise SinkStateError(
            f"job {job.name}: dedupe state {dedupe.state_sink} holds windows up to "
            f"{through}, but window {window_id} needs every window before it (was the lake "
            "lost or replaced?). Run `onceflow reconcile " + job.name + "`."
        )
    _log.info(
        "job %s: indexing the dedupe keys of %d window(s) from %s",
        job.name,
        len(missing),
        dedupe.state_sink,
    )
    seen = group.seen_keys(ctx.spark, dedupe.state_sink, list(dedupe.key), only=missing)
    writer = index.staging_writer(
        KEYS_OUTPUT,
        missing[-1],
        session_name(job.name, epoch),
        epoch=epoch,
        tag="index",
        fenced=ctx.exactly_once,
    )
    try:
        rows = 0
        if seen is not None:
            frame = key_frame(seen, dedupe.key, "__seen_in")
            rows = rows_written(run_writers({KEYS_OUTPUT: frame}, [writer]).written[writer.key])

        def add(conn: Any) -> bool:
            return index.add(conn, writer.table, missing, rows)

        if not ctx.ledger.write("index the dedupe keys", add):
            raise TransientSinkError("the dedupe key staging table lost rows; run again")
    finally:
        index.drop_staging(writer.table)
    return state.indexing(missing)


def _unskipped(ctx: JobContext, after: int, before: int) -> list[int]:
    """Windows between `after` and `before` (exclusive) that were not skipped."""
    skipped = {wid for wid, _ in ctx.ledger.skipped_windows()}
    return [w for w in range(after + 1, before) if w not in skipped]
