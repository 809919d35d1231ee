"""Complete: a committed window marked completed, its staged dedupe keys into the key index."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import Any

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
) -> bool:
    """Mark the window completed, moving its staged dedupe keys into the key index in the
    same transaction (and recording the sink `commits` that wrote it, for lineage); False
    if the keys were lost (the next window indexes them from the state sink)."""
    index = ctx.index
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
