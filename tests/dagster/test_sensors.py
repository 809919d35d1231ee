"""Sensors on a real instance: failed runs recovered once each; new input requested until the
ledger holds it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from dagster import (
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    SkipReason,
    build_sensor_context,
    job,
    op,
)

import definitions
from onceflow.generate import generate_payments
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from sensors import failure
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact


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


def test_failure_sensor_waits_for_dagsters_retry_verdict(monkeypatch) -> None:
    """Dagster stores a run's failure, then tags whether it will retry it: a run seen between the
    two is recovered only once the verdict says no retry is coming."""
    sensor = definitions.defs.get_sensor_def("payments_failure_sensor")
    with DagsterInstance.ephemeral(settings={"run_retries": {"enabled": True}}) as instance:
        tags = {"onceflow/job": "payments"}

        def failed_untagged() -> str:
            return instance.create_run_for_job(
                _failing, status=DagsterRunStatus.FAILURE, tags=tags
            ).run_id

        retried, dropped = failed_untagged(), failed_untagged()
        requests, cursor = _tick(sensor, instance, None)
        assert requests == []
        instance.add_run_tags(retried, {"dagster/will_retry": "true"})
        instance.add_run_tags(dropped, {"dagster/will_retry": "false"})
        requests, cursor = _tick(sensor, instance, cursor)
        assert [r.run_key for r in requests] == [dropped]
        assert _tick(sensor, instance, cursor)[0] == []
        # A recovery run's failure is never recovered, so it waits for no verdict: the cursor
        # moves past it at once.
        recovery = instance.create_run_for_job(
            _failing,
            status=DagsterRunStatus.FAILURE,
            tags={**tags, "onceflow/kind": "recovery"},
        ).run_id
        requests, cursor = _tick(sensor, instance, cursor)
        assert requests == []
        assert recovery in failure._load(cursor)[1]
        # A verdict that never comes (an instance whose daemon is down) does not hold it forever.
        stuck = failed_untagged()
        assert _tick(sensor, instance, cursor)[0] == []
        monkeypatch.setattr(failure, "UNDECIDED_GRACE", timedelta(0))
        assert [r.run_key for r in _tick(sensor, instance, cursor)[0]] == [stuck]


def test_new_data_sensor_follows_the_ledger_and_recovery_commits_unplanned_input(
    resources: dict, instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    defs = definitions.build_defs(resources)
    sensor = defs.resolve_sensor_def("payments_new_data_sensor")
    recovery_job = defs.resolve_job_def("payments_recovery_job")
    sensor_resources = {"onceflow": resources["onceflow"], "postgres": resources["postgres"]}

    def tick() -> list:
        context = build_sensor_context(instance=instance, resources=sensor_resources)
        out = sensor(context)
        return [] if isinstance(out, SkipReason) else list(out.run_requests or [])

    assert tick() == []  # nothing landed
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=4)
    (request,) = tick()
    assert request.tags["onceflow/job"] == "payments"
    assert request.tags["onceflow/unplanned_units"] == "2"
    # The launched run died before it planned anything: the input is still the ledger's to do,
    # so the next tick asks again (a cursor over file names would have moved past it).
    assert len(tick()) == 1
    # While a run of the job is in progress, it takes the work: no second request.
    running = DagsterRun(
        job_name="payments_job",
        status=DagsterRunStatus.STARTED,
        tags={"onceflow/job": "payments"},
    )
    instance.add_run(running)
    assert tick() == []
    instance.delete_run(running.run_id)

    # Recovery commits input no window has planned yet, not only pending windows.
    recovered = recovery_job.execute_in_process(instance=instance)
    assert recovered.success
    (mat,) = recovered.asset_materializations_for_node("payments_recovery")
    assert mat.metadata["windows_replayed"].value == 1
    assert mat.metadata["windows_incomplete"].value == 0
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert tick() == []  # nothing left to do


def test_new_data_sensor_restarts_a_follow_run_that_made_way(
    resources: dict, instance: DagsterInstance, landing: Path
) -> None:
    sensor = definitions.build_defs(resources).resolve_sensor_def("payments_new_data_sensor")
    assert sensor.job_name == "payments_follow_job"
    context = {"onceflow": resources["onceflow"], "postgres": resources["postgres"]}

    def tick() -> list:
        out = sensor(build_sensor_context(instance=instance, resources=context))
        return [] if isinstance(out, SkipReason) else list(out.run_requests or [])

    def follow_ended(how: str, status: DagsterRunStatus = DagsterRunStatus.SUCCESS) -> None:
        instance.add_run(
            DagsterRun(
                job_name="payments_follow_job",
                status=status,
                tags={"onceflow/job": "payments", "onceflow/follow_end": how},
            )
        )

    assert tick() == []  # no input, no follow run yet: nothing to do
    follow_ended("idle")
    assert tick() == []  # it ended for want of input: the next input starts the next one
    follow_ended("made_way")
    backfill = DagsterRun(
        job_name="payments_job", status=DagsterRunStatus.STARTED, tags={"onceflow/job": "payments"}
    )
    instance.add_run(backfill)
    assert tick() == []  # the run it made way for is still going
    instance.delete_run(backfill.run_id)
    (request,) = tick()  # over: following again, with no input waiting
    assert request.tags["onceflow/unplanned_units"] == "0"
    follow_ended("made_way", DagsterRunStatus.CANCELED)
    assert tick() == []  # terminated by an operator: not restarted until input lands


def test_new_data_sensor_leaves_the_work_to_dagsters_coming_retry(
    instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    # The sensor reads the ledger only: no Spark session is started for it.
    settings = OnceflowSettingsResource(
        home=str(tmp_path / "home"), lake=str(lake), landing=str(landing)
    )
    postgres = PostgresResource(dsn=pg_dsn)
    defs = definitions.build_defs(
        {"spark": SparkResource(), "postgres": postgres, "onceflow": settings}
    )
    sensor = defs.resolve_sensor_def("payments_new_data_sensor")

    def tick() -> list:
        context = build_sensor_context(
            instance=instance, resources={"onceflow": settings, "postgres": postgres}
        )
        out = sensor(context)
        return [] if isinstance(out, SkipReason) else list(out.run_requests or [])

    generate_payments(landing, records=100, files=1, seed=5)
    assert len(tick()) == 1
    # A run just failed and Dagster will retry it, but the retry does not exist yet: no run is
    # queued, yet a new one would only queue ahead of the retry and take its work.
    failed = _fail(instance, **{"onceflow/job": "payments", "dagster/will_retry": "true"})
    assert tick() == []
    # The retry exists (and has ended): the input is the sensor's again.
    instance.add_run_tags(failed, {"dagster/auto_retry_run_id": "a-retry"})
    assert len(tick()) == 1
    # A failure Dagster will not retry leaves the work to the sensor (and the failure sensor).
    _fail(instance, **{"onceflow/job": "payments", "dagster/will_retry": "false"})
    assert len(tick()) == 1


def test_new_data_sensor_observes_the_source_when_a_file_lands(
    instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    """The source asset's data version (the newest file's name and time) is observed on every
    change, without a run, so the UI never shows it "never observed" nor stale for nothing."""
    import os

    from dagster import AssetKey

    settings = OnceflowSettingsResource(
        home=str(tmp_path / "home"), lake=str(lake), landing=str(landing)
    )
    postgres = PostgresResource(dsn=pg_dsn)
    defs = definitions.build_defs(
        {"spark": SparkResource(), "postgres": postgres, "onceflow": settings}
    )
    sensor = defs.resolve_sensor_def("payments_new_data_sensor")

    def tick(cursor: str | None) -> tuple[list, str | None]:
        context = build_sensor_context(
            instance=instance, cursor=cursor, resources={"onceflow": settings, "postgres": postgres}
        )
        out = sensor(context)
        return list(out.asset_events or []), out.cursor

    (empty,), cursor = tick(None)  # observed at once, even with nothing landed
    assert empty.asset_key == AssetKey("payments_landing")
    assert tick(cursor)[0] == []  # unchanged: not observed again
    generate_payments(landing, records=50, files=1, seed=6)
    (landed,), cursor = tick(cursor)
    assert landed.tags["dagster/data_version"] != empty.tags["dagster/data_version"]
    assert landed.metadata["units"].value == 1
    # The same file written again (a new modification time) is new input too.
    (newest,) = sorted(landing.rglob("*.jsonl"))
    stat = newest.stat()
    os.utime(newest, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    (again,), cursor = tick(cursor)
    assert again.tags["dagster/data_version"] != landed.tags["dagster/data_version"]
    assert tick(cursor)[0] == []
