"""What a maintenance run did: plain, frozen data with `as_json()`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onceflow.maintain._detail import DetailPruned
from onceflow.sinks.maintenance import TableMaintained


@dataclass(frozen=True)
class MaintainResult:
    """What `onceflow maintain JOB` did (or, with `dry_run`, would do) per Delta sink."""

    job: str
    dry_run: bool
    tables: tuple[TableMaintained, ...] = field(default_factory=tuple)
    detail: DetailPruned = field(default_factory=lambda: DetailPruned(0, 0))

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "maintain",
            "job": self.job,
            "dry_run": self.dry_run,
            "tables": [t.as_json() for t in self.tables],
            "ledger_detail": self.detail.as_json(),
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
                f"{t.keep_version}; log records kept through version {t.log_records_through}"
            )
            out.extend(
                f"  vacuum held back: job {h.job} {h.reason} (needs version {h.version})"
                for h in t.binding
            )
            out.extend(f"  {n}" for n in t.notes)
        if not out:
            out.append(f"job {self.job} has no Delta sink: no table to maintain")
        out.append(self.detail.line(self.dry_run))
        return out
