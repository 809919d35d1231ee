"""What a Dagster run asks of the engine, and the metadata it reports; no protocol logic here."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from dagster import Backoff, Failure, Jitter, MetadataValue, RetryPolicy, RetryRequested

from assets.config import WindowRunConfig
from onceflow import ConfigurationError, Engine, Job, OnceflowError, ops
from onceflow.ops import (
    WindowsResult,
    cancel_command,
    format_windows,
    is_terminal,
    needs_recovery,
    parse_windows,
    redact,
    request_of,
)
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from sensors.failure import MAX_RETRIES_TAG, TERMINAL_TAG

# Offsets of at most this many windows go into one materialisation's metadata.
MAX_OFFSETS_IN_METADATA = 50
# A step that fails with an error the core marks transient (`retryable`) is tried again up to
# 3 times, after about 3, 9 and 21 s (Dagster's exponential backoff, (2^n - 1) x delay), each
# ±3 s so the retries of several jobs spread out.
TRANSIENT_RETRY_POLICY = RetryPolicy(
    max_retries=3, delay=3, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS
)

T = TypeVar("T")

# The `mode` a materialisation reports, by operation.
MODES = {"run": "new data", "backfill": "backfill", "restate": "restate", "follow": "follow"}


class _RunContext(Protocol):
    """What marking a run needs of a step's context (an asset's or an op's)."""

    @property
    def instance(self) -> Any: ...

    @property
    def run_id(self) -> str: ...

    @property
    def log(self) -> Any: ...


def make_engine(
    job: Job,
    spark: SparkResource,
    postgres: PostgresResource,
    onceflow: OnceflowSettingsResource,
) -> Engine:
    """The engine for one run of `job` on the run's resources."""
    settings = onceflow.settings()
    return ops.open_engine(
        job, settings, spark=spark.spark_session, dsn=postgres.resolve(settings.home)
    )


def at_boundary(fn: Callable[..., T], context: _RunContext | None = None) -> Callable[..., T]:
    """Turn errors into Dagster's: retry only what the core marks transient (`retryable`),
    by the step's retry policy (`TRANSIENT_RETRY_POLICY`, exponential backoff); fail anything
    else at once with its message (credentials redacted), and never retry it at the step.

    A step whose op has a retry policy retries every exception except a `Failure` with
    `allow_retries=False`, so every other error is turned into one here. A terminal error
    (`onceflow.errors.is_terminal`) also marks `context`'s run (`mark_terminal`): Dagster's run
    retries and the failure sensor's recovery leave it alone.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (Failure, RetryRequested):
            raise
        except Exception as exc:
            mark_terminal(context, exc)
            raise as_failure(exc) from _cause(exc)

    return wrapper


def iter_at_boundary(events: Iterator[T], context: _RunContext | None = None) -> Iterator[T]:
    """`at_boundary` for a step that yields its events as it goes."""
    try:
        yield from events
    except (Failure, RetryRequested):
        raise
    except Exception as exc:
        mark_terminal(context, exc)
        raise as_failure(exc) from _cause(exc)


def mark_terminal(context: _RunContext | None, exc: BaseException) -> None:
    """Tag the run failing with `exc`: when the error needs recovery, so it is not retried
    (`dagster/max_retries=0`); when it is terminal, so it is neither retried nor recovered: `dagster/max_retries=0`, which Dagster reads from the run's tags when it
    decides `dagster/will_retry` at the run's failure, and `onceflow/terminal_failure=<run id>`,
    which the failure sensor reads (the run's own id: a re-execution inherits its parent's
    tags, and its own failure is judged anew)."""
    if context is None:
        return
    if needs_recovery(exc):
        # Running the same work again fails the same way; the failure sensor's recovery is
        # what repairs it.
        context.instance.add_run_tags(context.run_id, {MAX_RETRIES_TAG: "0"})
        context.log.error(
            f"{type(exc).__name__}: this run is not retried; the failure sensor starts a "
            "recovery (verify, replay, reconcile)."
        )
        return
    if not is_terminal(exc):
        return
    context.instance.add_run_tags(
        context.run_id, {MAX_RETRIES_TAG: "0", TERMINAL_TAG: context.run_id}
    )
    context.log.error(
        f"{type(exc).__name__} is terminal: this run is not retried and no recovery is "
        "started; the error says what to change, then run again."
    )


def _cause(exc: Exception) -> Exception | None:
    """What the failure chains to: not a known, final error, whose message says it all."""
    return None if isinstance(exc, OnceflowError) and not exc.retryable else exc


def as_failure(exc: Exception) -> Failure:
    """The step failure for `exc`, retried by the step's policy only when it is transient."""
    if isinstance(exc, OnceflowError):
        return Failure(
            description=redact(exc.message),
            metadata={"error": type(exc).__name__, "retryable": exc.retryable},
            allow_retries=exc.retryable,
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Failure(
        description=f"unexpected {type(exc).__name__}: {redact(first)[:500]}",
        metadata={"error": type(exc).__name__, "retryable": False},
        allow_retries=False,
    )


def run_windows(
    engine: Engine, config: WindowRunConfig, run_id: str, request_id: str, log: Any
) -> WindowsResult:
    """Process new data, or backfill / restate the windows `config` names (`onceflow.ops`).

    Args:
        engine: The job's engine.
        config: The run's configuration.
        run_id: The Dagster run id, recorded with every commit.
        request_id: Names a restatement request: the root run id, so a retried run restates
            each window once.
        log: Where to say what happened (Dagster's run log).
    """
    if not config.windows:
        if config.restate:
            raise ConfigurationError(
                "restate needs `windows`: name the windows to restate, e.g. 3-7."
            )
        report = ops.run(engine, run_id=run_id, max_units_per_window=config.max_files_per_window)
    else:
        ids = parse_windows(config.windows)
        if config.restate:
            report = ops.restate(engine, ids, run_id=run_id, request_id=request_id)
        else:
            report = ops.backfill(engine, ids, run_id=run_id)
    _log_windows(report, log)
    return report


def _log_windows(report: WindowsResult, log: Any) -> None:
    for wid in report.noop_windows:
        log.info(f"window {wid} already committed in every sink; nothing changed")
    for note in report.notes:
        log.warning(note)
    if not report.windows and not report.noop_windows:
        log.info("no pending windows and no new input; nothing changed")
    for window in report.committed:
        done = sorted(s.sink for s in window.sinks if s.committed)
        held = sorted(s.sink for s in window.sinks if s.already_committed)
        log.info(
            f"window {window.window_id}: {MODES[report.kind]}, committed to {', '.join(done)}"
            + (f"; already held by {', '.join(held)}" if held else "")
        )


def sink_metadata(report: WindowsResult, sink: str, data_version: int | None) -> dict[str, Any]:
    """Materialisation metadata of one sink asset for one run; counts as ints so the UI plots."""
    mine = [(w, o) for w in report.windows if (o := w.sink(sink)) is not None]
    committed = [w for w, outcome in mine if outcome.committed]
    already = sorted(
        {w.window_id for w, o in mine if o.already_committed} | set(report.noop_windows)
    )
    seen = sorted({w.window_id for w, _ in mine} | set(report.noop_windows))

    def total(key: str) -> int:
        return sum(int(w.stats.get(key, 0) or 0) for w in committed)

    metadata: dict[str, Any] = {
        "mode": MetadataValue.text(MODES[report.kind]),
        "windows": MetadataValue.text(format_windows(seen) or "none"),
        "windows_committed": MetadataValue.int(len(committed)),
        "windows_already_committed": MetadataValue.int(len(already)),
        "noop": MetadataValue.bool(not committed),
        "rows_in": MetadataValue.int(total("rows_in")),
        "rows_kept": MetadataValue.int(total("kept")),
        "duplicates": MetadataValue.int(total("duplicates")),
        "quarantined": MetadataValue.int(total("quarantined")),
        "rows_written": MetadataValue.int(sum(o.rows for _, o in mine if o.committed)),
        "commit_latency_s": MetadataValue.float(
            round(float(sum(o.latency_s for _, o in mine if o.committed)), 4)
        ),
    }
    if committed:
        metadata["window_first"] = MetadataValue.int(committed[0].window_id)
        metadata["window_last"] = MetadataValue.int(committed[-1].window_id)
        metadata["offsets"] = MetadataValue.json(
            {
                str(w.window_id): _offsets_summary(w.offsets)
                for w in committed[-MAX_OFFSETS_IN_METADATA:]
            }
        )
    xids = [o.commit_ref for _, o in mine if o.committed and o.commit_ref]
    if xids:
        metadata["transaction_id"] = MetadataValue.text(xids[-1])
    if data_version is not None:
        metadata["delta_version"] = MetadataValue.int(data_version)
    if report.notes:
        metadata["notes"] = MetadataValue.md("\n".join(f"- {n}" for n in report.notes))
    return metadata


def open_items_metadata(engine: Engine) -> dict[str, Any]:
    """Unfinished restatements, skipped and abandoned windows, shown on every materialisation
    until the restatements are finished (skips and abandonments stay: they are the operator's
    record; an abandoned window is a known gap in the sinks named)."""
    items = ops.open_items(engine)
    abandoned: dict[str, dict[str, str]] = {}
    for wid, sink, reason in items.abandoned[-50:]:
        abandoned.setdefault(sink, {})[str(wid)] = reason
    job = engine.job.name
    return {
        "windows_abandoned": MetadataValue.int(len({wid for wid, _, _ in items.abandoned})),
        "abandoned": MetadataValue.json(abandoned),
        "restatements_pending": MetadataValue.int(len(items.restatements)),
        "restatements_pending_windows": MetadataValue.text(
            format_windows(sorted({wid for _, wid, _ in items.restatements})) or "none"
        ),
        "restatements_pending_cancel": MetadataValue.text(
            "\n".join(sorted({cancel_command(job, req) for _, _, req in items.restatements}))
            or "none"
        ),
        "restatements_cancelled": MetadataValue.json(
            {
                str(seq): {"window": wid, "request": request_of(req), "reason": reason}
                for seq, wid, req, reason in items.cancelled[-50:]
            }
        ),
        "windows_skipped": MetadataValue.int(len(items.skipped)),
        "skipped": MetadataValue.json({str(wid): reason for wid, reason in items.skipped[-50:]}),
    }


def _offsets_summary(offsets: dict[str, Any]) -> dict[str, Any]:
    """A window's offsets, short: long lists become their length and ends."""
    out: dict[str, Any] = {}
    for key, value in offsets.items():
        if isinstance(value, list) and len(value) > 2:
            out[key] = {"count": len(value), "first": value[0], "last": value[-1]}
        else:
            out[key] = value
    return out
