"""Where a Delta sink's log records a window's commit (for lineage of a window an earlier run
committed and a later one completed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.sinks.delta import _records
from onceflow.sinks.delta._log import commit_info, window_of

if TYPE_CHECKING:
    from onceflow.sinks.delta.table import DeltaTableSink

# Log entries read, newest first, to find the commit of a window held but not yet completed.
WINDOW_SEARCH = 1000


def window_commits(
    sink: DeltaTableSink, window_ids: Sequence[int], *, limit: int = WINDOW_SEARCH
) -> dict[int, tuple[int, dict[str, Any]]]:
    """Window id → (the table version whose commit carries the window's app transaction,
    that commit's info), for those of `window_ids` found.

    Read newest first, entry by entry by name, down to the commit of the lowest window
    asked for: windows commit in order, so a window held but not yet completed is among
    the newest and costs a few reads, never a scan of the whole log. Stops at `limit`
    entries or at an entry log cleanup removed (that window's record is gone)."""
    wanted = set(window_ids)
    found: dict[int, tuple[int, dict[str, Any]]] = {}
    if not wanted or not sink.exists():
        return found
    lowest = min(wanted)
    newest = sink.table().version()
    reached = False
    for version, window, actions in _window_entries(sink, newest, limit):
        if window in wanted:
            found[window] = (version, commit_info(actions))
        if window <= lowest or len(found) == len(wanted):
            reached = True
            break
    if not reached and sink.first_entry() is None:
        # The log was cleaned: the records kept beside it name the older windows.
        for record in _records.read(sink).values():
            if record.window in wanted and record.window not in found:
                found[record.window] = (record.version, record.info)
    return found


def commits_after(sink: DeltaTableSink, after: int) -> list[tuple[int, dict[str, Any]]]:
    """(window id, commit info) of every window commit above window `after` the log still
    names, oldest window first.

    Read newest first by name down to the commit of window `after` (windows commit in
    order), so a ledger that knows every window through `after` costs the entries since,
    not the whole log. Nothing when the table holds no window above `after`. Stops at an
    entry log cleanup removed (`DeltaGroup.unrecorded` tells whether that matters)."""
    if not sink.exists():
        return []
    table = sink.table()
    if (table.transaction_version(sink.app_id) or 0) <= after:
        return []
    found: dict[int, dict[str, Any]] = {}
    reached = False
    for _, window, actions in _window_entries(sink, table.version()):
        if window <= after:
            reached = True
            break
        found[window] = commit_info(actions)
    if not reached:
        # The walk met an entry log cleanup removed (or the log's start): the records kept
        # beside the log name the windows of the removed entries.
        for window, info in _records.windows(sink, after).items():
            found.setdefault(window, info)
    return sorted(found.items(), key=lambda f: f[0])


def _window_entries(
    sink: DeltaTableSink, newest: int, limit: int | None = None
) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """(version, window id, actions) of each of this job's window commits, read by name from
    version `newest` down (at most `limit` entries), until an entry log cleanup removed.
    Entries of no window (an epoch claim, a restatement, maintenance) are passed over."""
    last = -1 if limit is None else max(newest - limit, -1)
    for version in range(newest, last, -1):
        actions = sink.entry_actions(version)
        if actions is None:
            return
        window = window_of(actions, sink.app_id)
        if window is not None:
            yield version, window, actions


def window_history(sink: DeltaTableSink) -> list[dict[str, Any]]:
    """This job's window commits recorded in the table, oldest window first: the log's
    entries, and the records kept beside the log for the entries log cleanup removed."""
    from onceflow.sinks.delta.table import META_PREFIX

    if not sink.exists():
        return []
    kept = [{**r.info, "version": r.version} for r in _records.read(sink).values()]
    by_window: dict[int, dict[str, Any]] = {}
    for entry in [*kept, *sink.table().history()]:
        if (
            entry.get(f"{META_PREFIX}job") == sink.job
            and entry.get(f"{META_PREFIX}sink", sink.sink) == sink.sink
            and f"{META_PREFIX}window_id" in entry
        ):
            by_window[int(entry[f"{META_PREFIX}window_id"])] = entry
    return [by_window[w] for w in sorted(by_window)]
