"""A failed quality check launches the job's recovery once, and the recovery repairs the sinks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckResult,
    AssetKey,
    DagsterInstance,
    SkipReason,
    asset,
    asset_check,
    build_sensor_context,
    job,
    materialize,
    op,
)

import definitions
from assets import build_job_assets
from onceflow.generate import generate_payments
from onceflow.registry import get_job
from sensors.quality import build_quality_sensor
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.dagster


@pytest.fixture()
def instance(disk_instance: DagsterInstance) -> DagsterInstance:
    return disk_instance  # SQLite as `dagster dev` has it: an event log sharded by run


def _tick(sensor, instance: DagsterInstance, cursor: str | None) -> tuple[list, str | None]:
    out = sensor(build_sensor_context(instance=instance, cursor=cursor))
    if isinstance(out, SkipReason):
        return [], cursor
    return list(out.run_requests or []), out.cursor


def _quality(result) -> dict[str, bool]:
    return {e.asset_key.to_user_string(): e.passed for e in result.get_asset_check_evaluations()}


def test_failed_quality_check_is_recovered_once(
    resources: dict, instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    defs = definitions.build_defs(resources)
    run_job = defs.resolve_job_def("payments_job")
    recovery_job = defs.resolve_job_def("payments_recovery_job")
    sensor = defs.resolve_sensor_def("payments_quality_sensor")

    generate_payments(landing, records=1000, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=1)
    ok = run_job.execute_in_process(instance=instance)
    assert ok.success
    assert all(_quality(ok).values())
    requests, cursor = _tick(sensor, instance, None)
    assert requests == []  # passed checks launch nothing

    # Damage from outside onceflow: a committed payment disappears from PostgreSQL.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        deleted = conn.execute(
            "DELETE FROM payments WHERE payment_id = (SELECT min(payment_id) FROM payments)"
        ).rowcount
    assert deleted == 1
    # A run of the job finds no new data and runs the checks: the run succeeds (the checks do
    # not block), the pg_payments check fails.
    checked = run_job.execute_in_process(instance=instance, raise_on_error=False)
    assert checked.success
    assert _quality(checked)["pg_payments"] is False

    requests, cursor = _tick(sensor, instance, cursor)
    assert len(requests) == 1
    (request,) = requests
    assert request.run_key.startswith(f"{checked.run_id}:")
    assert request.tags["onceflow/trigger"] == "quality_check"
    assert request.tags["onceflow/check_run_id"] == checked.run_id
    assert "pg_payments" in request.tags["onceflow/failed_checks"].split(",")
    assert _tick(sensor, instance, cursor)[0] == []

    # Another run in the same retry chain fails the same check: no second recovery.
    retry = run_job.execute_in_process(
        instance=instance,
        raise_on_error=False,
        tags={"dagster/root_run_id": checked.run_id, "dagster/parent_run_id": checked.run_id},
    )
    assert _quality(retry)["pg_payments"] is False
    requests, cursor = _tick(sensor, instance, cursor)
    assert requests == []

    recovered = recovery_job.execute_in_process(
        instance=instance, tags=request.tags, run_config=request.run_config
    )
    assert recovered.success
    (mat,) = recovered.asset_materializations_for_node("payments_recovery")
    assert mat.metadata["reconcile"].value == "full"
    assert mat.metadata["pg_payments.missing"].value == 1
    assert mat.metadata["pg_payments.repaired"].value is True
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

    # The checks pass again, and the sensor stays quiet.
    again = run_job.execute_in_process(instance=instance)
    assert again.success
    assert all(_quality(again).values())
    assert _tick(sensor, instance, cursor)[0] == []


def test_quality_sensor_cursor_on_check_history(instance: DagsterInstance) -> None:
    """Without Spark: checks that fail or pass on demand, on the same key as the real one."""
    outcome = {"passed": True}

    @asset(key="pg_payments")
    def _sink() -> int:
        return 1

    @asset_check(asset="pg_payments", name="quality")
    def _check() -> AssetCheckResult:
        return AssetCheckResult(passed=outcome["passed"])

    _run_job, recovery_job, *_others = build_job_assets(get_job("payments")).jobs
    sensor = build_quality_sensor(
        get_job("payments"),
        recovery_job,
        [AssetCheckKey(AssetKey("pg_payments"), "quality")],
        "payments_recovery",
    )

    def check(passed: bool) -> str:
        outcome["passed"] = passed
        # Not blocking: the run succeeds, and only this sensor notices the failure.
        result = materialize([_sink, _check], instance=instance)
        assert _quality(result) == {"pg_payments": passed}
        return result.run_id

    # Old history on the first tick: a failure a later pass superseded needs nothing.
    check(False)
    check(True)
    latest = check(False)
    requests, cursor = _tick(sensor, instance, None)
    assert [r.tags["onceflow/check_run_id"] for r in requests] == [latest]
    assert requests[0].run_config["ops"]["payments_recovery"]["config"]["reconcile"] == "full"
    assert _tick(sensor, instance, cursor)[0] == []

    # Failed, then passed before the next tick: repaired already.
    check(False)
    check(True)
    requests, cursor = _tick(sensor, instance, cursor)
    assert requests == []

    # Two runs failing between ticks: one recovery each, each once.
    runs = [check(False), check(False)]
    requests, cursor = _tick(sensor, instance, cursor)
    assert [r.tags["onceflow/check_run_id"] for r in requests] == runs
    assert len({r.run_key for r in requests}) == 2
    assert _tick(sensor, instance, cursor)[0] == []

    # One run evaluating the check twice (as a follow run does): passed, seen by a tick, then
    # failed. Dagster updates the run's one execution in place, behind the sensor's cursor.
    go_on = threading.Event()

    @op(out={})
    def _evaluate_twice() -> Iterator[AssetCheckEvaluation]:
        key = AssetKey("pg_payments")
        yield AssetCheckEvaluation(asset_key=key, check_name="quality", passed=True)
        assert go_on.wait(60)
        yield AssetCheckEvaluation(asset_key=key, check_name="quality", passed=False)

    @job
    def _checks_twice() -> None:
        _evaluate_twice()

    done: list = []
    runner = threading.Thread(
        target=lambda: done.append(_checks_twice.execute_in_process(instance=instance)), daemon=True
    )
    runner.start()
    key = AssetCheckKey(AssetKey("pg_payments"), "quality")

    def latest_status() -> str | None:
        found = instance.event_log_storage.get_latest_asset_check_execution_by_key([key])
        record = found.get(key)
        return str(record.status.value) if record else None

    deadline = time.monotonic() + 60
    while latest_status() != "SUCCEEDED":
        assert time.monotonic() < deadline, "the first evaluation never arrived"
        time.sleep(0.2)
    requests, cursor = _tick(sensor, instance, cursor)
    assert requests == []
    go_on.set()
    runner.join(60)
    assert done and done[0].success
    requests, cursor = _tick(sensor, instance, cursor)
    assert [r.tags["onceflow/check_run_id"] for r in requests] == [done[0].run_id]
    assert _tick(sensor, instance, cursor)[0] == []
