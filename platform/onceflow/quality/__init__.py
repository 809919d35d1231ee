"""Great Expectations suites that prove a job's sinks hold no duplicates and lost nothing."""

from __future__ import annotations

from onceflow.quality.suites import DeltaTableTarget, PostgresTableTarget, SumConsistency, Target
from onceflow.quality.validate import CheckResult, ValidationReport, validate

__all__ = [
    "CheckResult",
    "DeltaTableTarget",
    "PostgresTableTarget",
    "SumConsistency",
    "Target",
    "ValidationReport",
    "validate",
]
