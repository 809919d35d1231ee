"""The operations on a job, for any orchestrator: each a function returning plain data.

    from onceflow import ops

    result = ops.run("payments", run_id="nightly-2026-01-01")
    print(result.as_json())

`cli.py` and the Dagster layer only present these, and import nothing of the core but
`onceflow` and `onceflow.ops`: the names a presenter needs to show a result (window ids as text,
reports, the types results carry, `redact`) are re-exported here from `onceflow.ops._present`.
A `run_id` given again is the same request (see `onceflow.ops._windows`); `exit_code` maps a
failure to the command line's exit code.
"""

from __future__ import annotations

from onceflow.ops._admin import abandon, cancel_restatement, recompute
from onceflow.ops._checks import (
    freshness,
    lineage,
    open_items,
    pending_work,
    reconcile,
    status,
    validate,
)
from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._exit import (
    EXIT_CHECKS_FAILED,
    EXIT_FAILED,
    EXIT_FENCED,
    EXIT_INTERRUPTED,
    EXIT_NEEDS_RECOVERY,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_RETRYABLE,
    exit_code,
)
from onceflow.ops._maintain import MaintainResult, maintain
from onceflow.ops._present import (
    DEFAULT_MAX_UNITS_PER_WINDOW,
    Freshness,
    LineageRow,
    OpenItems,
    PendingWork,
    Progress,
    ReconcileReport,
    TableFacts,
    cancel_command,
    changed_input_message,
    debug_enabled,
    describe_dsn,
    format_report,
    format_status,
    format_windows,
    is_terminal,
    needs_recovery,
    parse_windows,
    redact,
    refusal_details,
    release_embedded,
    request_of,
    resolve_dsn,
)
from onceflow.ops._recover import VERIFY_LAST, recover
from onceflow.ops._results import (
    AbandonResult,
    CancelResult,
    GenerateResult,
    JobInfo,
    JobsResult,
    RecomputeResult,
    RecoverResult,
    RestatementItem,
    SinkDone,
    SkipResult,
    StatusResult,
    ValidateResult,
    WindowDone,
    WindowsResult,
)
from onceflow.ops._tools import (
    demo,
    generate,
    jobs,
    open_from_env,
    s3_server,
    serve_spark_connect,
    spark_cluster,
    spark_log,
)
from onceflow.ops._windows import backfill, restate, run, skip

__all__ = [
    "DEFAULT_MAX_UNITS_PER_WINDOW",
    "EXIT_CHECKS_FAILED",
    "EXIT_FAILED",
    "EXIT_FENCED",
    "EXIT_INTERRUPTED",
    "EXIT_NEEDS_RECOVERY",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_RETRYABLE",
    "VERIFY_LAST",
    "AbandonResult",
    "CancelResult",
    "Freshness",
    "GenerateResult",
    "JobInfo",
    "JobRef",
    "JobsResult",
    "LineageRow",
    "MaintainResult",
    "OpenItems",
    "PendingWork",
    "Progress",
    "RecomputeResult",
    "ReconcileReport",
    "RecoverResult",
    "RestatementItem",
    "SinkDone",
    "SkipResult",
    "StatusResult",
    "TableFacts",
    "ValidateResult",
    "WindowDone",
    "WindowsResult",
    "abandon",
    "backfill",
    "cancel_command",
    "cancel_restatement",
    "changed_input_message",
    "debug_enabled",
    "demo",
    "describe_dsn",
    "exit_code",
    "format_report",
    "format_status",
    "format_windows",
    "freshness",
    "generate",
    "is_terminal",
    "jobs",
    "lineage",
    "maintain",
    "needs_recovery",
    "open_engine",
    "open_from_env",
    "open_items",
    "parse_windows",
    "pending_work",
    "recompute",
    "reconcile",
    "recover",
    "redact",
    "refusal_details",
    "release_embedded",
    "request_of",
    "resolve_dsn",
    "restate",
    "run",
    "s3_server",
    "serve_spark_connect",
    "skip",
    "spark_cluster",
    "spark_log",
    "status",
    "validate",
]
