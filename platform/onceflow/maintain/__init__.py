"""Maintenance that keeps the guarantee: compaction, checkpoints, vacuum and log cleanup of a
job's Delta sinks, only past the horizon onceflow computes, and the ledger's per-window detail
dropped past the job's detail horizon (docs/design.md, "Maintenance"; docs/operating.md)."""

from __future__ import annotations

from onceflow.maintain._detail import DetailPruned
from onceflow.maintain._horizon import Hold, downstream_holds, readers
from onceflow.maintain._options import KEEP_DETAIL, ORPHAN_AGE, TARGET_FILE_BYTES, Options
from onceflow.maintain._report import MaintainResult, TableMaintained
from onceflow.maintain._run import maintain_job

__all__ = [
    "KEEP_DETAIL",
    "ORPHAN_AGE",
    "TARGET_FILE_BYTES",
    "DetailPruned",
    "Hold",
    "MaintainResult",
    "Options",
    "TableMaintained",
    "downstream_holds",
    "maintain_job",
    "readers",
]
