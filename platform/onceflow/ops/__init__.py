"""The operations on a job, for any orchestrator: each a function returning plain data.

    from onceflow import ops

    result = ops.run("payments", run_id="nightly-2026-01-01")
    print(result.as_json())

`cli.py` and the Dagster layer only present these. A `run_id` given again is the same request
(see `onceflow.ops._windows`); `exit_code` maps a failure to the command line's exit code.
"""

from __future__ import annotations

from onceflow.ops._checks import reconcile, status, validate
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
from onceflow.ops._recover import VERIFY_LAST, recover
from onceflow.ops._results import (
    RecoverResult,
    SinkDone,
    SkipResult,
    StatusResult,
    ValidateResult,
    WindowDone,
    WindowsResult,
)
from onceflow.ops._windows import backfill, restate, run, skip

__all__ = [
    "EXIT_CHECKS_FAILED",
    "EXIT_FAILED",
    "EXIT_FENCED",
    "EXIT_INTERRUPTED",
    "EXIT_NEEDS_RECOVERY",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_RETRYABLE",
    "VERIFY_LAST",
    "JobRef",
    "RecoverResult",
    "SinkDone",
    "SkipResult",
    "StatusResult",
    "ValidateResult",
    "WindowDone",
    "WindowsResult",
    "backfill",
    "exit_code",
    "open_engine",
    "reconcile",
    "recover",
    "restate",
    "run",
    "skip",
    "status",
    "validate",
]
