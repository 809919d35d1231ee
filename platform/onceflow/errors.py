"""The onceflow error hierarchy: each error says whether retrying can help."""

from __future__ import annotations


class OnceflowError(Exception):
    """Base of every onceflow error.

    `retryable` tells a retry loop (and Dagster's run retries) whether the same call can succeed
    later without anyone changing anything. `recoverable` tells an orchestrator that running the
    same work again cannot help, but recovery can (verify, replay, reconcile: it puts back what
    a sink lacks).
    """

    retryable: bool = False
    recoverable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type[OnceflowError], tuple[str]]:
        return (type(self), (self.message,))


class ConfigurationError(OnceflowError, ValueError):
    """Settings, a job definition or an argument are wrong; fix them and run again.

    Also a ValueError: it is a bad value, and callers that catch those keep working."""


class SourceError(OnceflowError):
    """The source cannot give the records a window needs (missing or changed input)."""


class SinkError(OnceflowError):
    """A sink refused or failed a write."""


class SinkStateError(SinkError):
    """A sink is not in the state the ledger expects: its table is missing, was replaced, or
    lacks windows or restatements it committed (deleted, recreated or restored from an older
    copy). Nothing was written; `onceflow reconcile` puts back what it lacks."""

    recoverable = True


class TransientSinkError(SinkError):
    """A sink failed in a way that a later attempt can get past (connection lost, conflict)."""

    retryable = True


class FencedError(OnceflowError):
    """A newer run of the same job has taken over; this run must stop without writing."""


class CommitUnknownError(SinkError):
    """A commit's outcome could not be decided within the time allowed; nothing is assumed."""

    retryable = True


class LedgerError(OnceflowError):
    """The ledger and the sinks disagree in a way the job cannot repair by itself."""


class UnverifiableWindowError(OnceflowError):
    """A window's input is gone, so its expected output cannot be recomputed."""


class UnsupportedTableError(OnceflowError):
    """A Delta table uses a feature onceflow does not read (deletion vectors, column mapping)."""


class PostgresUnavailableError(OnceflowError):
    """PostgreSQL stayed unreachable (connections lost or refused) past the retry limit."""

    retryable = True


def is_terminal(exc: BaseException) -> bool:
    """Whether `exc` needs someone to change something before the same work can succeed.

    Terminal: an onceflow error marked neither `retryable` nor `recoverable` (a wrong setting
    or argument, a refused operation, a fenced zombie). Running the same work again, as a retry
    or a recovery, only fails the same way; the message names the fix. Not terminal: a retryable
    or recoverable error, and any error onceflow does not know (a crash, a lost worker), which a
    new run or a recovery may get past.
    """
    return isinstance(exc, OnceflowError) and not (exc.retryable or exc.recoverable)


def needs_recovery(exc: BaseException) -> bool:
    """Whether `exc` is repaired by recovery, not by running the same work again (a sink that
    lacks windows or was replaced: `SinkStateError`)."""
    return isinstance(exc, OnceflowError) and exc.recoverable
