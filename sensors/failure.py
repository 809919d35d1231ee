"""The failure sensor: one recovery run per failed run of a job, bursts and old failures included.

A plain sensor over the run storage rather than `run_failure_sensor`, which starts after the
newest event (missing failures from before it ran), returns one request per tick, and skips a
failed run for good when its code raises.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from dagster import (
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

from onceflow import Job
from resources._annotations import typed
from sensors._target import RunTarget

JOB_TAG = "onceflow/job"
KIND_TAG = "onceflow/kind"
FAILED_RUN_TAG = "onceflow/failed_run_id"
WILL_RETRY_TAG = "dagster/will_retry"
# Read by Dagster from a failed run's tags when it decides whether to retry it.
MAX_RETRIES_TAG = "dagster/max_retries"
# Set on a run that failed with a terminal error (`onceflow.errors.is_terminal`); the value is
# the run's own id, so a re-execution, which inherits its parent's tags, is not taken for one.
TERMINAL_TAG = "onceflow/terminal_failure"
# A follow run's end (`sensors.new_data` reads it too); `interrupted`: stopped by a signal.
FOLLOW_END_TAG = "onceflow/follow_end"
INTERRUPTED = "interrupted"
# Runs updated this close to the cursor are read again (and deduplicated), so two failures
# stored with the same timestamp are never split across the cursor.
OVERLAP = timedelta(seconds=1)
MAX_RUNS_PER_TICK = 200
# Dagster stores a run's failure, then tags whether it will retry it: a failed run without the
# tag is undecided, read again next tick. After this long untagged it is taken as not retried.
UNDECIDED_GRACE = timedelta(seconds=60)


def _load(cursor: str | None) -> tuple[datetime | None, set[str]]:
    if not cursor:
        return None, set()
    state = json.loads(cursor)
    return datetime.fromisoformat(state["after"]), set(state["seen"])


def _dump(after: datetime, seen: set[str]) -> str:
    return json.dumps({"after": after.isoformat(), "seen": sorted(seen)})


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def build_failure_sensor(
    job: Job,
    recovery: RunTarget,
    *,
    interval_s: int = 30,
) -> SensorDefinition:
    """A sensor requesting `recovery` once per failed run tagged `onceflow/job=<job>`.

    Runs Dagster will retry (`dagster/will_retry=true`) are left to the retry; recovery runs'
    own failures are left to the reconcile schedule, so a lasting outage is not a tight loop;
    runs that failed with a terminal error (`TERMINAL_TAG`) are not recovered: only the change
    their error names helps.
    With run retries on, a failed run not yet tagged either way waits for its tag (up to
    `UNDECIDED_GRACE`): recovering it then would race the retry Dagster is about to create.
    The run key is the failed run's id, so a failed run gets one recovery run whatever the
    cursor does.
    """

    @sensor(
        name=f"{job.name}_failure_sensor",
        job=recovery,
        minimum_interval_seconds=interval_s,
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name}'s recovery once per failed run of {job.name}.",
    )
    @typed
    def _failures(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        after, seen = _load(context.cursor)
        records = context.instance.get_run_records(
            RunsFilter(
                statuses=[DagsterRunStatus.FAILURE],
                tags={JOB_TAG: job.name},
                updated_after=(after - OVERLAP) if after else None,
            ),
            order_by="update_timestamp",
            ascending=True,
            limit=MAX_RUNS_PER_TICK,
        )
        requests = []
        newest = after
        undecided: dict[str, datetime] = {}
        now = datetime.now(timezone.utc)
        for record in records:
            run = record.dagster_run
            updated = _utc(record.update_timestamp)
            newest = max(newest, updated) if newest else updated
            if run.run_id in seen:
                continue
            if (
                run.tags.get(KIND_TAG) == "recovery"
                or run.tags.get(TERMINAL_TAG) == run.run_id
                or run.tags.get(FOLLOW_END_TAG) == INTERRUPTED
            ):
                # Never recovered, retried or not: no verdict to wait for. A terminal error
                # fails a recovery the same way; its message names the fix.
                seen.add(run.run_id)
                continue
            if (
                context.instance.run_retries_enabled
                and WILL_RETRY_TAG not in run.tags
                and now - updated < UNDECIDED_GRACE
            ):
                undecided[run.run_id] = updated
                continue
            seen.add(run.run_id)
            if run.tags.get(WILL_RETRY_TAG) == "true":
                continue
            requests.append(
                RunRequest(
                    run_key=run.run_id,
                    tags={FAILED_RUN_TAG: run.run_id},
                )
            )
            context.log.info(f"run {run.run_id} of {job.name} failed; requesting recovery")
        if newest is None:
            return SkipReason(f"no failed run of {job.name}")
        if undecided:
            # Read the undecided runs again next tick; the decided ones after them stay in `seen`.
            newest = min(newest, *undecided.values())
        # Only runs inside the overlap can be read again; older ids need not be remembered.
        if records:
            seen = {
                r.dagster_run.run_id
                for r in records
                if _utc(r.update_timestamp) > newest - OVERLAP
                and r.dagster_run.run_id not in undecided
            }
        cursor = _dump(newest, seen)
        if not requests:
            return SensorResult(skip_reason=f"no new failed run of {job.name}", cursor=cursor)
        return SensorResult(run_requests=requests, cursor=cursor)

    return _failures
