"""What the commands share: opening a job's engine, a window's line, a result as JSON, and the
options every operation takes (--run-id, --json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from onceflow import ops

# Where this process's Spark writes its log, once a session is started (for messages).
spark_log: Path | None = None


def engine_for(
    job_name: str, guarantee: str | None = None, *, spark: bool = True, check_input: bool = False
) -> Any:
    global spark_log
    engine = ops.open_from_env(job_name, spark=spark, check_input=check_input, guarantee=guarantee)
    if spark:
        spark_log = ops.spark_log(engine.settings)
    return engine


def window_line(result: Any) -> str:
    stats = result.stats or {}
    if result.noop:
        return f"window {result.window_id}: already committed in every sink; nothing changed"
    sinks = ", ".join(
        f"{name}={'held' if s.already_committed else s.rows}" for name, s in result.sinks.items()
    )
    return (
        f"window {result.window_id}: {units(result.offsets)}, "
        f"{stats.get('rows_in', 0)} records, {stats.get('kept', 0)} kept, "
        f"{stats.get('duplicates', 0)} duplicates, {stats.get('quarantined', 0)} quarantined; "
        f"{sinks} ({result.latency_s:.2f}s)"
    )


def windows_ahead(engine: Any, max_units: int | None) -> int | None:
    """Windows a run will process (pending plus new), for the progress display; None if the
    source cannot say cheaply."""
    try:
        work = ops.pending_work(engine)
    except Exception:  # the run itself reports what is wrong
        return None
    size = max_units or ops.DEFAULT_MAX_UNITS_PER_WINDOW
    return len(work.pending_windows) + -(-work.unplanned // size)


def units(offsets: dict[str, Any]) -> str:
    if "files" in offsets:
        return f"{len(offsets['files'])} file(s)"
    if "start" in offsets and "end" in offsets:
        return f"versions {offsets['start']}-{offsets['end']}"
    return "input"


def emit(result: Any) -> None:
    """The result as one JSON object on stdout."""
    print(json.dumps(result.as_json(), indent=2, default=str))


def echo_to(args: argparse.Namespace) -> Any:
    """Where a command's lines go: stdout, or stderr when stdout carries the JSON result."""
    return sys.stderr if getattr(args, "json", False) else None


def add_run_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-id",
        default=None,
        help="name this request: run again with the same id, it is the same request (a retry "
        "commits or restates nothing twice)",
    )


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout"
    )
