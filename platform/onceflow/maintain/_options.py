"""How a maintenance run treats a job's tables (defined with the sinks' maintenance contract)."""

from onceflow.sinks.maintenance import KEEP_DETAIL, ORPHAN_AGE, TARGET_FILE_BYTES, Options

__all__ = ["KEEP_DETAIL", "ORPHAN_AGE", "TARGET_FILE_BYTES", "Options"]
