"""Sensors on a real instance: failed runs recovered once each, new files requested once each."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DagsterInstance, SkipReason, build_sensor_context, job, op

import definitions
from onceflow.generate import generate_payments
from resources import OnceflowSettingsResource


@op
def _boom() -> None:
    raise RuntimeError("boom")


@job
def _failing() -> None:
    _boom()


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def _fail(instance: DagsterInstance, **tags: str) -> str:
    result = _failing.execute_in_process(instance=instance, raise_on_error=False, tags=tags)
    assert not result.success
    return result.run_id


def _tick(sensor, instance: DagsterInstance, cursor: str | None):
    out = sensor(build_sensor_context(instance=instance, cursor=cursor))
    if isinstance(out, SkipReason):
        return [], cursor
    return list(out.run_requests or []), out.cursor


def test_failure_sensor_bursts_old_failures_once_each(instance: DagsterInstance) -> None:
    sensor = definitions.defs.get_sensor_def("payments_failure_sensor")
    # Failures from before the sensor ever ran, in a burst, are all recovered.
    burst = [_fail(instance, **{"onceflow/job": "payments"}) for _ in range(3)]
    _fail(instance, **{"onceflow/job": "payments", "dagster/will_retry": "true"})
    _fail(instance, **{"onceflow/job": "payments", "onceflow/kind": "recovery"})
    _fail(instance, **{"onceflow/job": "other"})
    requests, cursor = _tick(sensor, instance, None)
    assert sorted(r.run_key for r in requests) == sorted(burst)
    assert all(r.tags["onceflow/failed_run_id"] == r.run_key for r in requests)
    again, cursor = _tick(sensor, instance, cursor)
    assert again == []
    later = _fail(instance, **{"onceflow/job": "payments"})
    requests, cursor = _tick(sensor, instance, cursor)
    assert [r.run_key for r in requests] == [later]
    assert _tick(sensor, instance, cursor)[0] == []


def test_new_data_sensor_requests_each_batch_once(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    sensor = definitions.defs.get_sensor_def("payments_new_data_sensor")
    resources = {"onceflow": OnceflowSettingsResource(home=str(tmp_path), landing=str(landing))}

    def tick(cursor: str | None) -> tuple[list, str | None]:
        out = sensor(build_sensor_context(cursor=cursor, resources=resources))
        if isinstance(out, SkipReason):
            return [], cursor
        return list(out.run_requests or []), out.cursor

    requests, cursor = tick(None)
    assert requests == []
    seen_keys: list[str] = []
    for seed in (1, 2, 3):
        generate_payments(landing, records=20, files=2, seed=seed)
        requests, cursor = tick(cursor)
        assert len(requests) == 1
        seen_keys.append(requests[0].run_key)
        assert requests[0].tags["onceflow/job"] == "payments"
        files = sorted(p.name for p in (landing / "payments").iterdir())
        assert requests[0].tags["onceflow/source_version"] == f"{len(files)}:payments/{files[-1]}"
        assert tick(cursor)[0] == []  # nothing new: nothing repeated
    assert len(set(seen_keys)) == 3
    assert cursor == f"{len(files)}:payments/{max(files)}"
