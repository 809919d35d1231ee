"""How a failed command is told: one line on stderr, the whole traceback with ONCEFLOW_DEBUG=1,
and with --json the failure as the one JSON object on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from onceflow import ops
from onceflow.ops import redact


def failure_summary(exc: BaseException) -> str:
    """One line saying what failed. A job's Python code failing on an executor (Spark's
    `PythonException`, whose first line says only that) is told by the error's type and the
    job's frame it was raised in; its text, which may quote values, is left to Spark's log."""
    import re

    text = str(exc).strip()
    if type(exc).__name__ != "PythonException":
        return text.splitlines()[0] if text else ""
    kinds = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))\b", text, re.M)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    where = f" at {Path(frames[-1][0]).name}, line {frames[-1][1]}, in {frames[-1][2]}"
    return f"the job's code raised {kinds[-1] if kinds else 'an error'} on an executor" + (
        where if frames else ""
    )


def traceback_text(exc: BaseException) -> str:
    """The whole traceback, with the errors behind `exc` even where a message left them out
    (`raise … from None`); credentials removed, and PostgreSQL's messages (which may quote a
    row's values) reduced to their SQLSTATE and identifiers."""
    import traceback

    import psycopg

    from onceflow.ops import refusal_details

    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            frames = "".join(traceback.format_tb(current.__traceback__))
            parts.append(
                f"Traceback (most recent call last):\n{frames}{type(current).__module__}."
                f"{type(current).__qualname__}: SQLSTATE {current.sqlstate} "
                f"({refusal_details(current) or 'no identifiers'}; its text is left out: it "
                "may quote a row's values)\n"
            )
        else:
            parts.append("".join(traceback.format_exception(current, chain=False)))
        current = current.__cause__ or current.__context__
    between = "\nDuring handling of the above exception, another exception occurred:\n\n"
    return redact(between.join(reversed(parts)))


def emit_failure(args: argparse.Namespace, exc: BaseException, code: int, message: str) -> None:
    """With --json, the failure as the one JSON object on stdout (its message also on stderr)."""
    if not getattr(args, "json", False):
        return
    failure = {
        "operation": args.command,
        "ok": False,
        "error": type(exc).__name__,
        "message": message,
        "retryable": code == ops.EXIT_RETRYABLE,
        "needs_recovery": code == ops.EXIT_NEEDS_RECOVERY,
        "exit_code": code,
    }
    try:
        print(json.dumps(failure, indent=2))
        sys.stdout.flush()
    except OSError:  # nobody reads stdout any more; stderr has said it
        pass
