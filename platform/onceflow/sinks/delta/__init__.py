"""Delta sinks: the spec users write, and the group that owns the Delta commit protocol."""

from __future__ import annotations

from onceflow.sinks.delta.group import DeltaGroup
from onceflow.sinks.delta.spec import DeltaSink
from onceflow.sinks.delta.table import DeltaCommit, DeltaTableSink

__all__ = ["DeltaCommit", "DeltaGroup", "DeltaSink", "DeltaTableSink"]
