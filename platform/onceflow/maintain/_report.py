"""What a maintenance run did: plain, frozen data with `as_json()`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onceflow.maintain._horizon import Hold


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


@dataclass(frozen=True)
class MaintainResult:
    """What `onceflow maintain JOB` did (or, with `dry_run`, would do) per Delta sink."""

    job: str
    dry_run: bool
    tables: tuple[TableMaintained, ...] = field(default_factory=tuple)

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "maintain",
            "job": self.job,
            "dry_run": self.dry_run,
            "tables": [t.as_json() for t in self.tables],
        }

    def lines(self) -> list[str]:
        """The result as text, a few lines per table."""
        verb = "would remove" if self.dry_run else "removed"
        out = []
        for t in self.tables:
            out.append(
                f"{t.sink}: version {t.version_before} -> {t.version_after}; files "
                f"{t.files_before} ({t.bytes_before} B) -> {t.files_after} ({t.bytes_after} B); "
                f"compacted {t.compacted_files}; checkpoint at {t.checkpoint_version}; "
                f"{verb} {t.files_vacuumed} vacuumed, {t.orphans_removed} orphan(s), "
                f"{t.log_entries_removed} log file(s); kept every file from version "
                f"{t.keep_version}"
            )
            out.extend(
                f"  vacuum held back: job {h.job} {h.reason} (needs version {h.version})"
                for h in t.binding
            )
            out.extend(f"  {n}" for n in t.notes)
        return out or [f"job {self.job} has no Delta sink: nothing to maintain"]
