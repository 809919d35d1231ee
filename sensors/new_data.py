"""The new-data sensor: a run whenever a job has input the ledger has not planned or committed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone

from dagster import (
    AssetKey,
    AssetObservation,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from onceflow import Job, ops
from onceflow.ops import PendingWork
from resources._annotations import typed
from resources.postgres import PostgresResource
from resources.settings import OnceflowSettingsResource
from sensors._target import RunTarget
from sensors.failure import FOLLOW_END_TAG, JOB_TAG, WILL_RETRY_TAG
from sensors.observation import observed_version, source_observation

INTERVAL_ENV = "ONCEFLOW_SENSOR_INTERVAL_S"
# Runs that will still take a job's pending work.
IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]
DEFAULT_INTERVAL_S = 30
# Set by Dagster's retry daemon on a failed run once its retry exists.
AUTO_RETRY_RUN_TAG = "dagster/auto_retry_run_id"
# Set by a follow run when it ends: `made_way` (for another run of the job) or `idle`.
MADE_WAY = "made_way"
# How long a failed run marked for retry, whose retry does not exist yet, counts as in flight.
# The daemon creates retries within seconds (it reads run failures every 5 s); past this, the
# retry is taken as lost and the sensor requests a run itself.
RETRY_GRACE = timedelta(minutes=2)


def default_interval_s() -> int:
    """`ONCEFLOW_SENSOR_INTERVAL_S` when set (at least 1), else 30 seconds.

    Dagster's sensor daemon ticks at most every 5 seconds, whatever is set here.
    """
    value = os.environ.get(INTERVAL_ENV, "").strip()
    return max(1, int(value)) if value else DEFAULT_INTERVAL_S


def build_new_data_sensor(
    job: Job,
    target: RunTarget,
    tags: Mapping[str, str],
    *,
    interval_s: int | None = None,
    observe: AssetKey | None = None,
    resume: str | None = None,
) -> SensorDefinition:
    """A sensor requesting a run of `target` while the job has work the ledger has not done,
    and observing the job's source asset `observe` (when given) whenever its data version
    changed since the last tick (the version is kept in the cursor): a run-less observation,
    so the UI's staleness follows the source within one tick, with or without a run.

    The trigger is derived from the ledger (`onceflow.status.pending_work`): input no window
    has planned, or planned windows some sink does not hold. It is not a cursor over what a
    launched run was meant to do, so a run that dies before it plans anything leaves the input
    to the next request rather than behind. While a run of the job is queued or in progress, or
    has just failed and Dagster is about to retry it, no new run is requested (that run, or the
    retry, takes the work). The interval defaults to `default_interval_s()`.

    `resume`: the job's follow job, when `target` is it. A follow run that made way for another
    run of the job (a backfill, a recovery) is started again once that run is over, with or
    without pending work, so the next file does not wait for a run's start.
    """

    @sensor(
        name=f"{job.name}_new_data_sensor",
        job=target,
        minimum_interval_seconds=interval_s if interval_s is not None else default_interval_s(),
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Requests a run of {job.name} while it has unplanned input or pending windows.",
    )
    @typed
    def _new_data(
        context: SensorEvaluationContext,
        onceflow: OnceflowSettingsResource,
        postgres: PostgresResource,
    ) -> SensorResult | SkipReason:
        settings = onceflow.settings()
        events: list[AssetObservation] = []
        cursor = context.cursor
        if observe is not None:
            seen = source_observation(job, observe, settings)
            if observed_version(seen) != context.cursor:
                events, cursor = [seen], observed_version(seen)
        engine = ops.open_engine(job, settings, dsn=postgres.resolve(settings.home))
        request, reason = _decide(context, job, tags, ops.pending_work(engine), resume)
        return SensorResult(
            run_requests=[request] if request is not None else None,
            skip_reason=reason,
            cursor=cursor,
            asset_events=events,
        )

    return _new_data


def _decide(
    context: SensorEvaluationContext,
    job: Job,
    tags: Mapping[str, str],
    work: PendingWork,
    resume: str | None = None,
) -> tuple[RunRequest | None, str | None]:
    """The run to request for the job's pending `work`, or why none."""
    if not work.any and not (resume and _made_way(context, resume)):
        return None, f"{job.name}: no unplanned input and no pending window"
    busy = context.instance.get_run_records(
        RunsFilter(tags={JOB_TAG: job.name}, statuses=IN_FLIGHT), limit=1
    )
    if busy:
        return None, (
            f"{job.name}: run {busy[0].dagster_run.run_id} is queued or running; it takes "
            "the pending work"
        )
    retrying = _awaiting_retry(context, job)
    if retrying:
        return None, (
            f"{job.name}: run {retrying} failed and Dagster is about to retry it; the retry "
            "takes the pending work"
        )
    request = RunRequest(
        tags={
            **tags,
            "onceflow/unplanned_units": str(work.unplanned),
            "onceflow/pending_windows": str(len(work.pending_windows)),
        },
    )
    return request, None


def _made_way(context: SensorEvaluationContext, follow_job: str) -> bool:
    """Whether the newest run of `follow_job` ended well, making way for another run."""
    records = context.instance.get_run_records(RunsFilter(job_name=follow_job), limit=1)
    if not records:
        return False
    run = records[0].dagster_run
    return run.status == DagsterRunStatus.SUCCESS and run.tags.get(FOLLOW_END_TAG) == MADE_WAY


def _awaiting_retry(context: SensorEvaluationContext, job: Job) -> str | None:
    """A run of `job` that failed lately and that Dagster will retry, with no retry yet.

    Between a run's failure and its retry's creation (up to a retry daemon tick) no run of the
    job is queued, yet the retry is coming: a run requested then would only queue ahead of it
    and take its work. Bounded by `RETRY_GRACE`, so a retry that never comes (the daemon gave
    up, which also sets `will_retry=false`) does not hold the job's input back.
    """
    since = datetime.now(timezone.utc) - RETRY_GRACE
    records = context.instance.get_run_records(
        RunsFilter(
            tags={JOB_TAG: job.name, WILL_RETRY_TAG: "true"},
            statuses=[DagsterRunStatus.FAILURE],
            updated_after=since,
        ),
        limit=20,
    )
    waiting = [r for r in records if AUTO_RETRY_RUN_TAG not in r.dagster_run.tags]
    return waiting[0].dagster_run.run_id if waiting else None
