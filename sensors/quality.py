"""The quality sensor: a failed quality check of a job launches the job's recovery, once per run.

It reads the asset check executions (`get_asset_check_execution_history`), which every event
log storage indexes, SQLite's run-sharded one included; `get_event_records` with a storage-id
cursor refuses check evaluations there. Executions are read once per key and tick, all
statuses together, and sorted by status name here: the status enum lives in `dagster._core`,
which this layer does not import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetCheckKey,
    DagsterEventType,
    DagsterInstance,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from onceflow import Job
from resources._annotations import typed
from sensors._target import RunTarget
from sensors.failure import KIND_TAG

TRIGGER_TAG = "onceflow/trigger"
CHECK_RUN_TAG = "onceflow/check_run_id"
FAILED_CHECKS_TAG = "onceflow/failed_checks"
# Executions read per check and page; a tick pages on until it reaches its cursor.
PAGE = 100
MAX_EXECUTIONS_PER_TICK = 1000
# Names of Dagster's check execution statuses, and its retry-chain tag.
_FAILED = "FAILED"
_PLANNED = "PLANNED"
_SUCCEEDED = "SUCCEEDED"
ROOT_RUN_ID_TAG = "dagster/root_run_id"
# Retry chains already given a recovery, remembered so a retry's failure does not add another.
REMEMBERED_CHAINS = 100


@dataclass
class _Cursor:
    """Every failed execution with id <= `after` is handled; `done` holds handled ids above it.

    Execution ids are given when a check is planned, so an execution still running can finish
    after a newer one: `after` never passes an execution whose run is still going, nor one
    planned after the tick began. `chains` are the retry chains given a recovery lately.
    """

    after: int = 0
    done: set[int] = field(default_factory=set)
    chains: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, text: str | None) -> _Cursor:
        if not text:
            return cls()
        state = json.loads(text)
        return cls(int(state["after"]), set(state["done"]), list(state["chains"]))

    def dump(self) -> str:
        return json.dumps(
            {
                "after": self.after,
                "done": sorted(self.done),
                "chains": self.chains[-REMEMBERED_CHAINS:],
            }
        )


def _history(
    instance: DagsterInstance,
    key: AssetCheckKey,
    after: int,
    limit: int = MAX_EXECUTIONS_PER_TICK,
) -> list[Any]:
    """The newest `limit` executions of `key` with id > `after`, newest first, any status
    (`record.status.value`: PLANNED, SUCCEEDED, FAILED, …).

    Older executions past the limit are passed over: the recovery of a newer failure
    reconciles every window anyway.
    """
    found: list[Any] = []
    page_cursor: int | None = None
    while len(found) < limit:
        size = min(PAGE, limit - len(found))
        page = instance.event_log_storage.get_asset_check_execution_history(
            key, limit=size, cursor=page_cursor
        )
        newer = [r for r in page if r.id > after]
        found.extend(newer)
        if len(page) < size or len(newer) < len(page):
            break
        page_cursor = page[-1].id
    return found


def _status(record: Any) -> str:
    return str(getattr(record.status, "value", record.status))


def _run_finished(instance: DagsterInstance, run_id: str) -> bool:
    run = instance.get_run_by_id(run_id)
    return run is None or run.is_finished


def _failed_evaluation_storage_id(
    instance: DagsterInstance, run_id: str, keys: set[AssetCheckKey]
) -> int | None:
    """Storage id of the run's first failed evaluation of one of `keys`."""
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION
    ).records
    for record in records:
        evaluation = record.event_log_entry.dagster_event.event_specific_data  # type: ignore[union-attr]
        if evaluation.asset_check_key in keys and not evaluation.passed:
            return record.storage_id
    return None


def build_quality_sensor(
    job: Job,
    recovery: RunTarget,
    check_keys: Sequence[AssetCheckKey],
    recovery_op: str,
    *,
    interval_s: int = 30,
) -> SensorDefinition:
    """A sensor requesting `recovery` once per run where one of `check_keys` failed.

    The request runs `recovery_op` (the recovery asset's op) with a full reconcile.

    Every failed evaluation since the cursor counts, from any run (a job run, or checks run
    from the UI). A run's failed evaluations are one batch and get one recovery; so does a
    retry chain (`dagster/root_run_id`), so Dagster's run retries do not multiply recoveries.
    The run key is the run id and the storage id of its first failed evaluation.

    The checks are not blocking: a failed check does not fail its run (the data it judges is
    committed already, and failing the run would only add a second recovery), so this sensor
    is what turns a failed check into a recovery, for checks run inside a job run or alone.
    """
    keys = set(check_keys)
    # A failed check says a sink disagrees with the ledger somewhere, not in which window: the
    # reconcile must compare every window, not only those since the last verified one.
    run_config = {"ops": {recovery_op: {"config": {"reconcile": "full"}}}}

    @sensor(
        name=f"{job.name}_quality_sensor",
        job=recovery,
        minimum_interval_seconds=interval_s,
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Launches {job.name}'s recovery once per run whose quality checks failed.",
    )
    @typed
    def _quality(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        instance = context.instance
        state = _Cursor.load(context.cursor)
        # Read first: executions planned after this point have larger ids, and the cursor stays
        # below them whatever happens to them during the tick.
        latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(list(keys))
        horizon = max([state.after, *(r.id for r in latest.values())])
        history = {key: _history(instance, key, state.after) for key in keys}
        running = [
            r.id
            for key in keys
            for r in history[key]
            if _status(r) == _PLANNED and r.id <= horizon and not _run_finished(instance, r.run_id)
        ]
        passed = {
            key: max((r.id for r in history[key] if _status(r) == _SUCCEEDED), default=0)
            for key in keys
        }
        failed = [
            r
            for key in keys
            for r in history[key]
            if _status(r) == _FAILED and r.id not in state.done
        ]
        # A run that evaluates a check more than once (a follow run) updates its one execution
        # in place, keeping its id: a failure after a pass the cursor already went by shows
        # only as the check's latest execution. Its run's chain, and the run key, keep it to
        # one recovery.
        failed += [
            r
            for r in latest.values()
            if _status(r) == _FAILED and r.id <= state.after and r.id not in state.done
        ]
        # A failure its check has passed since (after some repair) needs no recovery any more.
        current = [r for r in failed if passed[r.key] < r.id]
        by_run: dict[str, list[Any]] = {}
        for record in sorted(current, key=lambda r: r.id):
            by_run.setdefault(record.run_id, []).append(record)
        requests = []
        for run_id, records in by_run.items():
            run = instance.get_run_by_id(run_id)
            tags = run.tags if run else {}
            chain = (run.root_run_id if run else None) or tags.get(ROOT_RUN_ID_TAG) or run_id
            # Recovery runs do not run the quality checks; never let them feed back anyway.
            if chain in state.chains or tags.get(KIND_TAG) == "recovery":
                continue
            state.chains.append(chain)
            storage_id = _failed_evaluation_storage_id(instance, run_id, keys)
            sinks = sorted({r.key.asset_key.to_user_string() for r in records})
            requests.append(
                RunRequest(
                    run_key=f"{run_id}:{storage_id if storage_id is not None else records[0].id}",
                    run_config=run_config,
                    tags={
                        TRIGGER_TAG: "quality_check",
                        CHECK_RUN_TAG: run_id,
                        FAILED_CHECKS_TAG: ",".join(sinks),
                    },
                )
            )
            context.log.info(
                f"quality checks of {', '.join(sinks)} failed in run {run_id}; requesting recovery"
            )
        handled = state.done | {r.id for r in failed}
        state.after = min(running) - 1 if running else horizon
        state.done = {i for i in handled if i > state.after}
        if not requests:
            return SensorResult(
                skip_reason=f"no new failed quality check of {job.name}", cursor=state.dump()
            )
        return SensorResult(run_requests=requests, cursor=state.dump())

    return _quality
