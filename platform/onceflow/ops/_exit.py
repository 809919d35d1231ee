"""Exit codes of the `onceflow` commands: what an orchestrator driving them relies on.

They are documented in the README ("Exit codes and machine-readable results").
"""

from __future__ import annotations

from onceflow.errors import FencedError, OnceflowError, needs_recovery

EXIT_OK = 0
# Failed; the message says what to change (a terminal error), or what went wrong unexpectedly.
EXIT_FAILED = 1
# A newer run of the same job took over; this one stopped without writing.
EXIT_FENCED = 3
# The command ran, and its checks found a problem (validate, recover's verification).
EXIT_CHECKS_FAILED = 4
# A sink lacks windows or was replaced: running again fails the same way; `onceflow recover`
# (or reconcile) repairs it.
EXIT_NEEDS_RECOVERY = 5
# Transient (EX_TEMPFAIL, sysexits.h): the same command, unchanged, may succeed later.
EXIT_RETRYABLE = 75
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # as a shell reports a command ended by SIGPIPE


def exit_code(exc: BaseException) -> int:
    """The exit code of a command that failed with `exc`."""
    if isinstance(exc, FencedError):
        return EXIT_FENCED
    if isinstance(exc, OnceflowError) and exc.retryable:
        return EXIT_RETRYABLE
    if needs_recovery(exc):
        return EXIT_NEEDS_RECOVERY
    return EXIT_FAILED
