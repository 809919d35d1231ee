"""A Delta table's files as commit actions: those the writers wrote, and a window's rows
rewritten out of the files holding them (a restatement)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.transaction import AddAction, PostCommitHookProperties, RemoveAction

from onceflow.storage import Location

# Checkpoints as delta-rs writes them, but no log cleanup after a commit: delta-rs would remove
# every entry older than `delta.logRetentionDuration` below the newest checkpoint, whatever a
# downstream job has not read yet. Only `onceflow maintain` cleans the log, past its horizon.
POST_COMMIT = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)


def add_actions(results: list[dict[str, Any]]) -> list[AddAction]:
    """Add actions for the files `ParquetFileWriter`s wrote (partitions without rows wrote none)."""
    return [
        AddAction(
            path=r["path"],
            size=int(r["size"]),
            partition_values={},
            modification_time=int(r["modified_ms"]),
            data_change=True,
            stats=json.dumps({"numRecords": int(r["rows"])}),
        )
        for r in sorted(results, key=lambda r: r.get("path", ""))
        if r.get("rows")
    ]


def rewrite_without_window(
    path: Location, table: DeltaTable, window_id: int, epoch: int
) -> tuple[list[RemoveAction], list[AddAction]]:
    """Remove actions for the files of the table at `path` holding the window's rows, and new
    files (written now) with the rest."""
    import pyarrow.compute as pc

    removes: list[RemoveAction] = []
    kept: list[AddAction] = []
    now_ms = int(time.time() * 1000)
    folder = f"r{window_id:010d}-e{epoch}-{uuid.uuid4().hex[:8]}"
    fs = path.filesystem()
    for add in pa.table(table.get_add_actions(flatten=True)).to_pylist():
        rel = add["path"]
        data = pq.read_table(fs.open_input_file((path / unquote(rel)).fs_path))
        mask = pc.equal(data["_window_id"], window_id)
        if not pc.any(mask).as_py():
            continue
        removes.append(
            RemoveAction(
                path=rel,
                data_change=True,
                deletion_timestamp=now_ms,
                size=add["size_bytes"],
                partition_values={},
            )
        )
        rest = data.filter(pc.invert(mask))
        if rest.num_rows:
            (path / folder).mkdir()
            kept.append(write_file(path, folder, rest, now_ms, data_change=True))
    return removes, kept


def write_file(
    path: Location, folder: str, data: pa.Table, now_ms: int, *, data_change: bool
) -> AddAction:
    """Write `data` as a new Parquet file in `folder` of the table at `path`; its add action."""
    name = f"{folder}/part-{uuid.uuid4().hex}.parquet"
    with path.filesystem().open_output_stream((path / name).fs_path) as out:
        pq.write_table(data, out)
        size = out.tell()
    return AddAction(
        path=name,
        size=size,
        partition_values={},
        modification_time=now_ms,
        data_change=data_change,
        stats=json.dumps({"numRecords": data.num_rows}),
    )
