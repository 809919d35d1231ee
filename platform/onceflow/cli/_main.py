"""The entry point: parse the command line, run the command, and turn a failure into its message
and exit code."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from onceflow import ConfigurationError, OnceflowError, ops
from onceflow.cli import _present
from onceflow.cli._failure import emit_failure, failure_summary, traceback_text
from onceflow.cli._parser import build_parser
from onceflow.ops import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, redact


def _exit_on(signum: int, frame: Any) -> None:
    # Leave through the normal exit path, which stops the embedded server this process started.
    raise SystemExit(128 + signum)


def _stdout_closed() -> bool:
    """Whether nothing reads our stdout any more (`onceflow status payments | head`)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `onceflow` console script."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("py4j", "pyspark", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)
    debug = ops.debug_enabled()
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except OnceflowError as exc:
        if debug:
            print(traceback_text(exc), file=sys.stderr)
        code = ops.exit_code(exc)
        if code == ops.EXIT_FENCED:
            print(f"onceflow: {redact(exc.message)}", file=sys.stderr)
        else:
            log = (
                f" Spark's log: {_present.spark_log}."
                if _present.spark_log is not None and not isinstance(exc, ConfigurationError)
                else ""
            )
            print(f"onceflow: {args.command} failed: {redact(exc.message)}{log}", file=sys.stderr)
        emit_failure(args, exc, code, redact(exc.message))
        return code
    except KeyboardInterrupt:
        print("onceflow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            # Whoever read our output has stopped (`| head`): end quietly, as a shell tool
            # does; what is still buffered goes nowhere rather than fail at the exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE_CLOSED
        if debug:
            print(traceback_text(exc), file=sys.stderr)
        log = f" Spark's log: {_present.spark_log}." if _present.spark_log is not None else ""
        summary = redact(failure_summary(exc))[:500]
        print(
            f"onceflow: {args.command} failed with an unexpected {type(exc).__name__}: "
            f"{summary}. Nothing is lost: committed windows stay committed "
            f"and the next run replays the rest.{log}"
            + ("" if debug else " Set ONCEFLOW_DEBUG=1 for the whole traceback."),
            file=sys.stderr,
        )
        emit_failure(args, exc, EXIT_FAILED, summary)
        return EXIT_FAILED
    finally:
        ops.release_embedded()
