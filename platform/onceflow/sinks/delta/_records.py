"""A Delta table's commit records kept beside its log (`_onceflow/log_records/`), so the log
can be cleaned without losing what a lost ledger is rebuilt from.

A Delta-only job's windows are recorded only in their commit entries (the window's offsets and
epoch in the commit info). `onceflow maintain` copies every entry's record here before log
cleanup may remove it; a rebuild, the lacking-windows check and the lineage read the copy for
the versions the log no longer has.

Each file holds the records of the contiguous versions `lo..hi` its name gives, one JSON line
a version: `{"version", "window" (this job's app transaction in the entry, or null), "info"
(the commit info)}`, gzip-compressed. A file is written whole (one PUT, or a rename) before any
entry it covers is removed. Files may overlap (a cleanup cut off after writing, a merge cut off
before removing what it merged); readers take each version once.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.sinks.delta._log import commit_info, window_of

if TYPE_CHECKING:
    from onceflow.sinks.delta.table import DeltaTableSink
    from onceflow.storage import Location

FOLDER = "_onceflow/log_records"
# More files than this are merged into one by the next summary (keeps a reader's listing and
# reads bounded: a daily maintenance adds one file a day).
MERGE_AT = 8
READ_ATTEMPTS = 3
_NAME = re.compile(r"^(\d{20})-(\d{20})\.jsonl\.gzip$")


@dataclass(frozen=True)
class Record:
    """One log entry's record: its version, the window it committed (None: an epoch claim,
    a restatement, maintenance) and its commit info."""

    version: int
    window: int | None  # as `_lineage` reads it: the entry's app transaction of this job
    info: dict[str, Any]


def folder(sink: DeltaTableSink) -> Location:
    return sink.path / FOLDER


def _files(sink: DeltaTableSink) -> list[tuple[int, int, str]]:
    out = []
    for name in folder(sink).children():
        if m := _NAME.match(name):
            out.append((int(m.group(1)), int(m.group(2)), name))
    return sorted(out)


def covered_through(sink: DeltaTableSink) -> int:
    """The highest version H such that every version 0..H has a record kept here (-1: none)."""
    return _covered(_files(sink))


def _covered(files: list[tuple[int, int, str]]) -> int:
    through = -1
    for lo, hi, _ in files:
        if lo > through + 1:
            break
        through = max(through, hi)
    return through


def read(sink: DeltaTableSink) -> dict[int, Record]:
    """Every kept record, by version."""
    for attempt in range(READ_ATTEMPTS):
        records: dict[int, Record] = {}
        try:
            for _, _, name in _files(sink):
                records.update(_parse((folder(sink) / name).read_bytes()))
        except FileNotFoundError:  # merged away since the listing: list again
            if attempt + 1 == READ_ATTEMPTS:
                raise
            continue
        return records
    return {}


def windows(sink: DeltaTableSink, after: int = 0) -> dict[int, dict[str, Any]]:
    """Window id → commit info of the kept records of windows above `after`."""
    return {
        r.window: r.info for r in read(sink).values() if r.window is not None and r.window > after
    }


def whole(sink: DeltaTableSink) -> bool:
    """Whether the kept records and the log together name every version of the table: the
    records run from version 0 without a gap to a version the log still has (or the newest)."""
    through = covered_through(sink)
    if through < 0:
        return False
    return sink.entry_actions(through + 1) is not None or through >= sink.table().version()


def summarize(sink: DeltaTableSink, through: int) -> int:
    """Keep the records of versions up to `through` the kept files do not cover yet, read from
    the log by name; return the version they now cover through without a gap.

    Stops at the first entry the log no longer has (cleaned up by another writer before any
    record was kept): the versions past it are left for a later call to fill in as far as
    the log still has them, never skipped over."""
    files = _files(sink)
    covered = _covered(files)
    records: list[Record] = []
    for version in range(covered + 1, through + 1):
        actions = sink.entry_actions(version)
        if actions is None:
            break
        records.append(_record(sink, version, actions))
    if records:
        name = f"{records[0].version:020d}-{records[-1].version:020d}.jsonl.gzip"
        (folder(sink) / name).write_bytes(_dump(records))
        files = sorted([*files, (records[0].version, records[-1].version, name)])
        covered = records[-1].version
    if len(files) > MERGE_AT:
        _merge(sink, files)
    return covered


def _merge(sink: DeltaTableSink, files: list[tuple[int, int, str]]) -> None:
    """One file for the leading gap-free run of files; written before the merged ones go."""
    run: list[tuple[int, int, str]] = []
    through = -1
    for lo, hi, name in files:
        if lo > through + 1:
            break
        run.append((lo, hi, name))
        through = max(through, hi)
    if len(run) < 2:
        return
    records: dict[int, Record] = {}
    for _, _, name in run:
        records.update(_parse((folder(sink) / name).read_bytes()))
    merged = f"{0:020d}-{through:020d}.jsonl.gzip"
    (folder(sink) / merged).write_bytes(_dump([records[v] for v in sorted(records)]))
    fs = sink.path.filesystem()
    for _, _, name in run:
        if name != merged:
            try:
                fs.delete_file((folder(sink) / name).fs_path)
            except FileNotFoundError:
                pass


def _record(sink: DeltaTableSink, version: int, actions: list[dict[str, Any]]) -> Record:
    return Record(version, window_of(actions, sink.app_id), commit_info(actions))


def _dump(records: list[Record]) -> bytes:
    lines = (
        json.dumps({"version": r.version, "window": r.window, "info": r.info}, sort_keys=True)
        for r in records
    )
    return gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6)


def _parse(data: bytes) -> dict[int, Record]:
    out = {}
    for line in gzip.decompress(data).splitlines():
        if line.strip():
            item = json.loads(line)
            out[int(item["version"])] = Record(int(item["version"]), item["window"], item["info"])
    return out
