"""A Delta table's log as maintenance reads it: entries by name, their files and timestamps.

Read straight from `_delta_log` (by name and one listing), so the table's files can be told
apart without loading a snapshot per version: the files a version adds, every file any readable
entry names, and when each version was committed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from onceflow.storage import Location

_ENTRY = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?\.parquet$")
_CRC = re.compile(r"^(\d{20})\.crc$")


@dataclass
class LogFacts:
    """What the readable log entries say."""

    entries: list[int] = field(default_factory=list)  # versions with a JSON entry, ascending
    checkpoints: list[int] = field(default_factory=list)  # versions with a checkpoint
    adds: dict[int, list[str]] = field(default_factory=dict)  # version -> files it adds
    named: set[str] = field(default_factory=set)  # every file an entry adds or removes
    timestamps: dict[int, int] = field(default_factory=dict)  # version -> commit time, ms


def commit_info(actions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A log entry's commit info (empty when it has none)."""
    return dict(next((a["commitInfo"] for a in actions if "commitInfo" in a), None) or {})


def window_of(actions: Sequence[dict[str, Any]], app_id: str) -> int | None:
    """The window a log entry commits: its app transaction `app_id`'s version (None for an
    entry of no window: an epoch claim, a restatement, maintenance)."""
    return next(
        (
            int(a["txn"]["version"])
            for a in actions
            if "txn" in a and a["txn"].get("appId") == app_id
        ),
        None,
    )


def relative(table: Location, path: str) -> str | None:
    """A log action's path relative to the table folder, decoded; None if it lies outside."""
    parsed = urlparse(path)
    if len(parsed.scheme) > 1:
        text = unquote(parsed.path if parsed.scheme == "file" else path)
        prefix = table.uri.rstrip("/") + "/"
        return text[len(prefix) :] if text.startswith(prefix) else None
    return unquote(path)


def read_log(table: Location) -> LogFacts:
    """Every entry and checkpoint in the table's log, and the files the entries name."""
    log = table / "_delta_log"
    facts = LogFacts()
    for name in log.children():
        if m := _ENTRY.match(name):
            facts.entries.append(int(m.group(1)))
        elif m := _CHECKPOINT.match(name):
            facts.checkpoints.append(int(m.group(1)))
    facts.entries.sort()
    facts.checkpoints = sorted(set(facts.checkpoints))
    for version in facts.entries:
        try:
            data = (log / f"{version:020d}.json").read_bytes()
        except FileNotFoundError:  # cleaned up since the listing
            continue
        adds: list[str] = []
        for line in data.splitlines():
            if not line.strip():
                continue
            action: dict[str, Any] = json.loads(line)
            if "commitInfo" in action and "timestamp" in (action["commitInfo"] or {}):
                facts.timestamps[version] = int(action["commitInfo"]["timestamp"])
            for kind in ("add", "remove", "cdc"):
                entry = action.get(kind)
                if not entry:
                    continue
                rel = relative(table, entry["path"])
                if rel is None:
                    continue
                facts.named.add(rel)
                if kind == "add":
                    adds.append(rel)
        facts.adds[version] = adds
    return facts


def version_at(facts: LogFacts, cutoff_ms: int) -> int | None:
    """The newest readable version committed at or before `cutoff_ms` (None: all are newer)."""
    older = [v for v, ts in facts.timestamps.items() if ts <= cutoff_ms]
    return max(older) if older else None


def log_files_before(table: Location, version: int) -> list[Location]:
    """The log's entries, checksums and checkpoints of versions below `version`."""
    log = table / "_delta_log"
    out = []
    for name in log.children():
        m = _ENTRY.match(name) or _CHECKPOINT.match(name) or _CRC.match(name)
        if m and int(m.group(1)) < version:
            out.append(log / name)
    return out


def data_files(table: Location) -> Iterable[tuple[str, int, int]]:
    """The table folder's data files: (path relative to the table, size, mtime in ns).

    Leaves out the log and every file or folder whose name starts with `_` or `.` (Delta's
    rule for what is not data; `_change_data` is named by `cdc` actions and kept)."""
    base = table.fs_path.rstrip("/") + "/"
    for info in table.files(recursive=True):
        rel = info.path[len(base) :] if info.path.startswith(base) else None
        if rel is None or any(part[:1] in ("_", ".") for part in rel.split("/")):
            continue
        yield rel, int(info.size or 0), int(info.mtime_ns or 0)
