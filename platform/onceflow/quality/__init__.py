"""Great Expectations suites that prove a job's sinks hold no duplicates and lost nothing.

Each kind of sink defines its own targets (`SinkGroup.quality_targets`); they check themselves.
"""

from __future__ import annotations

from onceflow.quality.results import CheckResult, ValidationReport
from onceflow.quality.target import CheckRun, Target
from onceflow.quality.validate import validate

__all__ = [
    "CheckResult",
    "CheckRun",
    "Target",
    "ValidationReport",
    "validate",
]
