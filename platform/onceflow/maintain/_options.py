"""How a maintenance run treats a job's tables."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

# Files below this size are compacted; compaction writes files up to it.
TARGET_FILE_BYTES = 128 * 1024 * 1024
# A file no log entry names is removed only once older than this: a commit in flight (a window
# prepared while the one before it commits, a commit retrying its races) is far younger.
ORPHAN_AGE = timedelta(hours=1)


@dataclass(frozen=True)
class Options:
    """How a maintenance run treats a table."""

    dry_run: bool = False
    orphan_age: timedelta = ORPHAN_AGE
    target_file_bytes: int = TARGET_FILE_BYTES
    compact: bool = True
