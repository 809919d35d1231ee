"""The core's names a presenter (the command line, an orchestrator's layer) needs to read and
show the operations' results, in one place: window ids to and from text, reports as text, the
types results carry, and how an error is classed and shown without credentials.

Nothing here changes a job's state; the operations are in the other `onceflow.ops` modules."""

from __future__ import annotations

from onceflow.engine import DEFAULT_MAX_UNITS_PER_WINDOW
from onceflow.errors import is_terminal, needs_recovery
from onceflow.lineage import LineageRow
from onceflow.postgres import describe_dsn, redact, refusal_details, release_embedded, resolve_dsn
from onceflow.progress import Progress
from onceflow.reconcile import ReconcileReport, format_report
from onceflow.runs.changed import changed_input_message
from onceflow.runs.restate import cancel_command, request_of
from onceflow.sinks.contract import TableFacts
from onceflow.spark import debug_enabled
from onceflow.status import Freshness, OpenItems, PendingWork, format_status
from onceflow.windows import format_windows, parse_windows

__all__ = [
    "DEFAULT_MAX_UNITS_PER_WINDOW",
    "Freshness",
    "LineageRow",
    "OpenItems",
    "PendingWork",
    "Progress",
    "ReconcileReport",
    "TableFacts",
    "cancel_command",
    "changed_input_message",
    "debug_enabled",
    "describe_dsn",
    "format_report",
    "format_status",
    "format_windows",
    "is_terminal",
    "needs_recovery",
    "parse_windows",
    "redact",
    "refusal_details",
    "release_embedded",
    "request_of",
    "resolve_dsn",
]
