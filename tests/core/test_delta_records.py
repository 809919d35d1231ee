"""The commit records kept beside a Delta table's log (`sinks/delta/_records.py`): written in
gap-free ranges, merged, read back whole, and `whole` only while they and the log name every
version."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

from onceflow.sinks.delta import _records
from onceflow.sinks.delta.table import DeltaTableSink
from onceflow.storage import Location


def _table(path: Path, commits: int) -> DeltaTableSink:
    for i in range(commits):
        write_deltalake(str(path), pa.table({"n": [i]}), mode="append")
    return DeltaTableSink("job", "sink", Location.parse(str(path)))


def test_records_are_kept_in_ranges_merged_and_read_back(tmp_path: Path) -> None:
    sink = _table(tmp_path / "t", 3)
    assert _records.covered_through(sink) == -1 and not _records.whole(sink)
    assert _records.summarize(sink, 2) == 2
    assert _records.whole(sink)
    for i in range(_records.MERGE_AT + 2):  # one file per call: merged past MERGE_AT
        write_deltalake(str(sink.path), pa.table({"n": [i]}), mode="append")
        assert _records.summarize(sink, sink.table().version()) == sink.table().version()
    files = list((sink.path / _records.FOLDER).children())
    assert 1 <= len(files) <= _records.MERGE_AT, files
    kept = _records.read(sink)
    assert sorted(kept) == list(range(sink.table().version() + 1))
    assert all(r.info.get("operation") in ("CREATE TABLE", "WRITE") for r in kept.values())

    # The log's oldest entries removed below a checkpoint: the records still name every version.
    sink.table().create_checkpoint()
    for v in range(4):
        (sink.path.path / "_delta_log" / f"{v:020d}.json").unlink()
    assert _records.whole(sink)


def test_a_log_cleaned_by_another_writer_stops_the_records_and_is_not_whole(
    tmp_path: Path,
) -> None:
    sink = _table(tmp_path / "t", 6)
    assert _records.summarize(sink, 1) == 1
    # Entries 0-4 cleaned below a checkpoint by another writer, 2-4 before their records
    # were kept: the records stop at 1, and they and the log do not name versions 2-4.
    sink.table().create_checkpoint()
    for v in range(5):
        (sink.path.path / "_delta_log" / f"{v:020d}.json").unlink()
    assert _records.summarize(sink, sink.table().version()) == 1
    assert sorted(_records.read(sink)) == [0, 1]
    assert not _records.whole(sink)
