"""A job's follow run: one long Dagster run that commits new input as it lands, on a warm
Spark session, and hands the job over to any other run of it that is waiting.

One run per landed file pays a run's start on every file (queueing, a run worker's imports, a
Spark session); a follow run pays it once and then commits a file within seconds of it
landing. Each committed window is reported as it commits: one materialisation per sink asset,
with the window's metadata. The quality suites run between commits, never during one, at most
every `check_every_s`, and report as the sinks' `quality` check; the freshness check
(`input_planned_in_time`) is evaluated with them, so every check of the sinks is.

The protocol is the engine's own `Engine.run(follow=True)`: nothing here decides what is
committed. A follow run killed at any point is replayed like any crashed run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    AssetMaterialization,
    Config,
    DagsterExecutionInterruptedError,
    DagsterRunStatus,
    JobDefinition,
    OpExecutionContext,
    RunsFilter,
    in_process_executor,
    op,
)
from dagster import job as dagster_job
from pydantic import Field

from assets.catalog import LINEAGE_WINDOWS, lineage_table, lineage_view
from assets.checks import CHECK_NAME, FRESHNESS_CHECK, run_freshness, run_quality
from assets.runs import (
    TRANSIENT_RETRY_POLICY,
    at_boundary,
    iter_at_boundary,
    make_engine,
    sink_metadata,
)
from onceflow import Engine, Job, WindowResult, ops
from onceflow.ops import WindowDone, WindowsResult
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from resources._annotations import typed
from sensors.failure import INTERRUPTED, JOB_TAG, KIND_TAG, MAX_RETRIES_TAG
from sensors.new_data import FOLLOW_END_TAG, MADE_WAY
from sensors.observation import DATA_VERSION_TAG

FOLLOW_KIND = "follow"
# Statuses of a run that wants the job: the follow run makes way for it.
_WAITING = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]
# How often the follow run looks for another run of its job, in seconds.
HAND_OVER_EVERY_S = 2.0
# How long the op waits for the engine to finish its window once told to stop.
STOP_TIMEOUT_S = 300.0


class FollowConfig(Config):
    """What a follow run does.

    Attributes:
        max_files_per_window: Most units a new window takes (the engine's default when empty).
        poll_interval_s: How often to look for new input while there is none.
        check_every_s: Run the quality suites at most this often, between commits, once
            something was committed since they last ran (0: never).
        stop_after_idle_s: End the run after this long without new input (0: never; the
            new-data sensor starts the next one when input lands).
    """

    max_files_per_window: int | None = Field(default=None, ge=1)
    poll_interval_s: float = Field(default=0.5, gt=0)
    check_every_s: float = Field(default=60.0, ge=0)
    stop_after_idle_s: float = Field(default=0.0, ge=0)


def follow_job_name(job: Job) -> str:
    return f"{job.name}_follow_job"


def build_follow_job(
    job: Job, sinks: Sequence[AssetKey], pool: str, jobs: Sequence[str], assets: Sequence[AssetKey]
) -> JobDefinition:
    """The follow job of `job`, committing to the sink assets `sinks`.

    Args:
        pool: The job's concurrency pool, held while following.
        jobs: The Dagster jobs of `job` whose runs the follow run makes way for.
        assets: The assets of `job` whose runs (from the asset graph) it makes way for.
    """
    keys = {key.to_user_string(): key for key in sinks}
    waits_for = _Others(frozenset(jobs), frozenset(a.to_user_string() for a in assets))

    @op(
        name=f"{job.name}_follow",
        tags={JOB_TAG: job.name},
        # No outputs (`-> None`): it logs materialisations and check evaluations.
        pool=pool,
        retry_policy=TRANSIENT_RETRY_POLICY,
        description=(
            f"Commits {job.name}'s new input as it lands, until another run of the job waits."
        ),
    )
    @typed
    def _follow(
        context: OpExecutionContext,
        config: FollowConfig,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> None:
        # Not a generator: the events are logged from here, so the whole step runs inside
        # Dagster's interrupt boundary and SIGTERM/SIGINT always lands in this frame or below
        # (a generator's interrupt can be raised in Dagster's frames between two events, where
        # nothing stops the engine and the retry policy retries the step).
        if context.dagster_run.tags.get(FOLLOW_END_TAG) == INTERRUPTED:
            context.log.info("this follow run was interrupted; not following again")
            return
        events: Iterator[Any] | None = None
        try:
            engine = at_boundary(make_engine, context)(job, spark, postgres, onceflow)
            events = _follow_events(context, config, engine, keys, waits_for)
            for event in iter_at_boundary(events, context):
                context.log_event(event)
        except (KeyboardInterrupt, DagsterExecutionInterruptedError):
            # `make dev` stopping, or a termination from the UI: the engine stops after the
            # window it is in (closing `events` waits for it), and the run ends without a
            # retry: the step's retry policy would retry the interrupt, on a Spark server that
            # is stopping too.
            _mark_interrupted(context)
            if events is not None:
                _close(events)
            context.log.info(f"{job.name}: interrupted; stopped after the current window")

    @dagster_job(
        name=follow_job_name(job),
        tags={JOB_TAG: job.name, KIND_TAG: FOLLOW_KIND},
        executor_def=in_process_executor,
        description=(
            f"Follows {job.name}'s input: commits each new file within seconds, on one warm "
            "Spark session, and makes way for a backfill, restatement or recovery of the job."
        ),
    )
    def _job() -> None:
        _follow()

    return _job


def _follow_events(
    context: OpExecutionContext,
    config: FollowConfig,
    engine: Engine,
    keys: dict[str, AssetKey],
    others: _Others,
) -> Iterator[Any]:
    """Run the engine in follow mode on a thread; yield its windows and checks as events.

    The op's own thread stays with Dagster: it turns what the engine reports into events as
    they come (an op's events reach the run's log only when it yields them), and it tells the
    engine to stop, after its current window, when another run of the job is waiting or the
    run has been idle for `stop_after_idle_s`.
    """
    events: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    checker = _Checker(engine, keys, config.check_every_s, events.put)
    failure: list[BaseException] = []
    # When the engine last found no new input, after the last window (None: at work).
    idle_since: list[float | None] = [None]

    handing_over = threading.Event()

    def committed(window: WindowResult) -> None:
        checker.committed()
        idle_since[0] = None
        events.put(window)

    def idle() -> None:
        checker.maybe_run()  # work too: the idle time starts after it
        idle_since[0] = idle_since[0] or time.monotonic()

    def work() -> None:
        try:
            ops.run(
                engine,
                max_units_per_window=config.max_files_per_window,
                run_id=context.run_id,
                follow=True,
                poll_interval_s=config.poll_interval_s,
                stop=stop,
                on_window=committed,
                on_idle=idle,
            )
            if not handing_over.is_set():  # the run waiting for the job has its own checks
                checker.maybe_run(final=True)
        except BaseException as exc:  # handed to the op's thread, which raises it
            failure.append(exc)
        finally:
            events.put(_DONE)

    worker = threading.Thread(target=work, name=f"onceflow-follow-{engine.job.name}", daemon=True)
    worker.start()
    last_look = time.monotonic()
    try:
        while True:
            try:
                item = events.get(timeout=HAND_OVER_EVERY_S / 2)
            except queue.Empty:
                item = None
            if item is _DONE:
                break
            if isinstance(item, WindowResult):
                yield from _window_events(engine, item, keys)
            elif item is not None:
                yield item
            now = time.monotonic()
            if stop.is_set() or now - last_look < HAND_OVER_EVERY_S:
                continue
            last_look = now
            waiting = _waiting_run(context, engine.job.name, others)
            if waiting is not None:
                context.log.info(f"run {waiting} of {engine.job.name} is waiting: making way")
                handing_over.set()
                stop.set()
            elif (since := idle_since[0]) and now - since >= config.stop_after_idle_s > 0:
                context.log.info(f"no new input for {config.stop_after_idle_s:g}s: ending")
                stop.set()
    finally:
        # Terminated, interrupted or failing: the engine stops after the window it is in. A
        # window is seconds; an engine stuck past this bound dies with the run's process.
        stop.set()
        _join(worker, STOP_TIMEOUT_S)
    if failure:
        raise failure[0]
    if worker.is_alive():
        raise TimeoutError(
            f"{engine.job.name}: the engine did not finish its window within {STOP_TIMEOUT_S:g}s"
            " of being told to stop; the next run replays it"
        )
    # The new-data sensor starts a follow run that made way again once the other run is over.
    context.instance.add_run_tags(
        context.run_id, {FOLLOW_END_TAG: MADE_WAY if handing_over.is_set() else "idle"}
    )


_DONE = object()


def _join(worker: threading.Thread, timeout_s: float) -> None:
    """Wait for the engine's thread, through further interrupts (a second Ctrl-C, the SIGINT
    after a SIGTERM): the engine is already told to stop after its window."""
    deadline = time.monotonic() + timeout_s
    while worker.is_alive() and time.monotonic() < deadline:
        try:
            worker.join(min(1.0, max(0.0, deadline - time.monotonic())))
        except (KeyboardInterrupt, DagsterExecutionInterruptedError):
            continue


def _close(events: Iterator[Any]) -> None:
    """Close the events' generator (stopping the engine after its window and waiting for it),
    through further interrupts."""
    while True:
        try:
            events.close()  # type: ignore[attr-defined]
            return
        except (KeyboardInterrupt, DagsterExecutionInterruptedError):
            continue


def _mark_interrupted(context: OpExecutionContext) -> None:
    """Tag the run as ended by an interrupt, so neither the step's retry policy (see the op),
    Dagster's run retries (`dagster/max_retries=0`) nor the failure sensor runs it again; the
    new-data sensor starts a follow run when input waits."""
    context.instance.add_run_tags(
        context.run_id, {FOLLOW_END_TAG: INTERRUPTED, MAX_RETRIES_TAG: "0"}
    )


def _window_events(
    engine: Engine, window: WindowResult, keys: dict[str, AssetKey]
) -> Iterator[AssetMaterialization]:
    """One materialisation per sink asset the window changed: the window's own metadata."""
    if window.noop:
        return
    done = WindowDone.of(window)
    report = WindowsResult("follow", engine.job.name, "", (done,))
    recent = ops.lineage(engine, limit=LINEAGE_WINDOWS)
    gaps = engine.ledger.abandoned_reasons()
    for spec in engine.job.sinks:
        outcome = window.sinks.get(spec.name)
        if outcome is None or not outcome.committed or spec.name not in keys:
            continue
        version = engine.group_of[spec.name].data_version(spec.name)
        yield AssetMaterialization(
            asset_key=keys[spec.name],
            metadata={
                **sink_metadata(report, spec.name, version),
                "lineage": lineage_table(
                    recent, spec, {w: r for w, name, r in gaps if name == spec.name}
                ),
                "lineage_view": lineage_view(engine.job.name),
            },
            tags={DATA_VERSION_TAG: str(version)} if version is not None else None,
        )


class _Checker:
    """Runs the sink assets' checks on the engine's thread, between commits, when they are due:
    the quality suites and the freshness check, so a follow run evaluates every check of the
    assets it materialises."""

    def __init__(
        self,
        engine: Engine,
        keys: dict[str, AssetKey],
        every_s: float,
        emit: Callable[[AssetCheckEvaluation], None],
    ) -> None:
        self._engine, self._keys, self._every_s, self._emit = engine, keys, every_s, emit
        self._dirty = threading.Event()
        self._last = 0.0

    def committed(self) -> None:
        self._dirty.set()

    def maybe_run(self, final: bool = False) -> None:
        if not self._every_s or not self._dirty.is_set():
            return
        if not final and time.monotonic() - self._last < self._every_s:
            return
        self._dirty.clear()
        self._last = time.monotonic()
        for outcome in run_quality(self._engine.job, self._engine, self._keys):
            self._emit(
                AssetCheckEvaluation(
                    asset_key=self._keys[outcome.sink],
                    check_name=CHECK_NAME,
                    passed=outcome.passed,
                    metadata=outcome.metadata,
                    severity=AssetCheckSeverity.ERROR,
                    description=outcome.description,
                )
            )
        fresh = run_freshness(self._engine)
        for key in self._keys.values():
            self._emit(
                AssetCheckEvaluation(
                    asset_key=key,
                    check_name=FRESHNESS_CHECK,
                    passed=fresh.passed,
                    metadata=fresh.metadata,
                    severity=fresh.severity,
                    description=fresh.description,
                )
            )


class _Others(NamedTuple):
    jobs: frozenset[str]
    assets: frozenset[str]


def _waiting_run(context: OpExecutionContext, name: str, others: _Others) -> str | None:
    """Another run of the job `name`, queued or started: a run of one of its Dagster jobs
    (backfill, restatement, recovery), or a run from the asset graph selecting its assets
    (which carries no job tag)."""
    records = context.instance.get_run_records(RunsFilter(statuses=_WAITING), limit=200)
    for record in records:
        run = record.dagster_run
        if run.run_id == context.run_id or run.tags.get(KIND_TAG) == FOLLOW_KIND:
            continue
        if run.tags.get(JOB_TAG) == name or run.job_name in others.jobs:
            return run.run_id
        if {key.to_user_string() for key in (run.asset_selection or ())} & others.assets:
            return run.run_id
    return None
