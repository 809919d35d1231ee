"""What a sink kind's maintenance takes and gives (`onceflow maintain`): plain data, so the
kinds' packages and the maintenance run share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# Files below this size are compacted; compaction writes files up to it.
TARGET_FILE_BYTES = 128 * 1024 * 1024
# A file no log entry names is removed only once older than this: a commit in flight (a window
# prepared while the one before it commits, a commit retrying its races) is far younger.
ORPHAN_AGE = timedelta(hours=1)
# The ledger keeps the per-window detail only a look back reads (lineage rows, contributions)
# for windows planned within this; a month, as Delta's default log retention keeps a history.
KEEP_DETAIL = timedelta(days=30)


@dataclass(frozen=True)
class Options:
    """How a maintenance run treats a table."""

    dry_run: bool = False
    orphan_age: timedelta = ORPHAN_AGE
    target_file_bytes: int = TARGET_FILE_BYTES
    compact: bool = True
    keep_detail: timedelta = KEEP_DETAIL


@dataclass(frozen=True)
class Hold:
    """A reader that needs the table's files from `version` on (every file live at it)."""

    job: str
    version: int
    reason: str

    def as_json(self) -> dict[str, object]:
        return {"job": self.job, "version": self.version, "reason": self.reason}


@dataclass(frozen=True)
class TableMaintained:
    """One Delta sink's maintenance.

    Attributes:
        sink: The sink's name; `table` its location.
        version_before, version_after: The table's version before and after.
        files_before, bytes_before, files_after, bytes_after: Data files in the table folder
            (live or not) and their bytes, before and after.
        live_files_before, live_files_after: Files the newest version holds.
        compacted_files: Small files compaction rewrote (0: none, or a dry run).
        compaction_version: The version of the compaction commit (`dataChange=false`).
        checkpoint_version: The version a checkpoint was written at (None: none written).
        keep_version: Every file live at this version or later is kept (-1: every file).
        log_entries_removed: Log files (entries, checkpoints, checksums) removed.
        log_records_through: The log entries' commit records are kept beside the log through
            this version (-1: none kept).
        files_vacuumed, bytes_vacuumed: Files no kept version holds, removed.
        orphans_removed: Files no log entry names (a commit that lost a race, a killed
            writer), older than the orphan age, removed under the job's fence.
        held_by: What kept files: each downstream job's oldest needed version and why.
        binding: The holds that kept files the retention alone would have let go.
        fenced_epoch: The epoch taken to remove orphans (None: no fence was needed).
    """

    sink: str
    table: str
    version_before: int
    version_after: int
    files_before: int
    bytes_before: int
    files_after: int
    bytes_after: int
    live_files_before: int
    live_files_after: int
    compacted_files: int = 0
    compaction_version: int | None = None
    checkpoint_version: int | None = None
    keep_version: int = -1
    log_entries_removed: int = 0
    log_records_through: int = -1
    files_vacuumed: int = 0
    bytes_vacuumed: int = 0
    orphans_removed: int = 0
    held_by: tuple[Hold, ...] = ()
    binding: tuple[Hold, ...] = ()
    fenced_epoch: int | None = None
    notes: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in self.__dataclass_fields__
            if k not in ("held_by", "binding", "notes")
        }
        out["held_by"] = [h.as_json() for h in self.held_by]
        out["binding"] = [h.as_json() for h in self.binding]
        out["notes"] = list(self.notes)
        return out
