"""The follow run as shipped, under a real `dagster dev` with the shipped `dagster.yaml`: the
new-data sensor starts it; it commits files as they land; it makes way for a backfill launched
like the launchpad does and follows again after it; its run worker, killed with SIGKILL, costs
nothing lost or doubled."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from onceflow.status import pending_work
from tests.dagster.test_run_worker_killed import (
    ARTIFACTS,
    LedgerProbe,
    kill_tree,
    land,
    run_worker,
    status_of,
    wait_run,
)
from tests.support.dagster_dev import dagster_dev_env, running_dagster_dev, wait_for
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(1800)]

JOB = "payments"
FOLLOW_JOB = f"{JOB}_follow_job"
RUN_JOB = f"{JOB}_job"
IN_FLIGHT = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")
START_TIMEOUT_S = 240  # a sensor request until its run is started (a fresh worker's imports)
DONE_TIMEOUT_S = 420  # landed input until every sink holds it


def _follow_run(exclude: set[str]):
    def find(runs: list[dict]) -> dict | None:
        return next(
            (
                r
                for r in runs
                if r["jobName"] == FOLLOW_JOB
                and r["status"] == "STARTED"
                and r["runId"] not in exclude
            ),
            None,
        )

    return find


def _all_in(probe: LedgerProbe) -> bool:
    work = pending_work(probe.engine)
    return not work.unplanned and not work.pending_windows


def test_follow_run_commits_makes_way_and_survives_a_killed_worker(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    probe = LedgerProbe(pg_dsn, tmp_path / "onceflow", lake, landing)
    env = dagster_dev_env(
        tmp_path / "dagster_home",
        pg_dsn=pg_dsn,
        lake=lake,
        landing=landing,
        onceflow_home=tmp_path / "onceflow",
        extra={"ONCEFLOW_SENSOR_INTERVAL_S": "5"},
    )
    try:
        with running_dagster_dev(env, tmp_path / "dagster_dev.log") as dev:
            for name in (f"{JOB}_new_data_sensor", f"{JOB}_failure_sensor"):
                dev.start_sensor(name)
            dev.stop_sensor("daily_totals_new_data_sensor")
            for name in (f"{JOB}_reconcile_schedule", "daily_totals_reconcile_schedule"):
                dev.stop_schedule(name)

            land(landing, seed=21)
            first = wait_run(dev, "the sensor's follow run", _follow_run(set()), START_TIMEOUT_S)
            assert first["tags"]["dagster/sensor_name"] == f"{JOB}_new_data_sensor"
            wait_for("the first files in every sink", lambda: _all_in(probe), DONE_TIMEOUT_S, 1)
            # A file landing while it follows is committed by the same run.
            land(landing, seed=22)
            wait_for("a file landed while following", lambda: _all_in(probe), DONE_TIMEOUT_S, 1)
            assert dev.run(first["runId"])["status"] == "STARTED"

            # A backfill launched from the launchpad: the follow run makes way and ends well.
            backfill = dev.launch(RUN_JOB, {"ops": {f"{JOB}_run": {"config": {"windows": "1"}}}})
            wait_run(dev, "the backfill", status_of(backfill, ("SUCCESS",)), START_TIMEOUT_S * 2)
            assert dev.run(first["runId"])["status"] == "SUCCESS"

            # The backfill over, the sensor starts following again, with no input waiting.
            second = wait_run(
                dev, "the next follow run", _follow_run({first["runId"]}), START_TIMEOUT_S
            )
            assert second["tags"]["onceflow/unplanned_units"] == "0", second["tags"]
            # It commits the next input; its worker dies with SIGKILL while more input lands.
            # Dagster's run retry and the failure sensor's recovery follow.
            land(landing, seed=23)
            wait_for("the third files in every sink", lambda: _all_in(probe), DONE_TIMEOUT_S, 1)
            kill_tree(run_worker(dev, second["runId"]))
            land(landing, seed=24)
            wait_run(
                dev,
                "the killed follow run marked failed",
                status_of(second["runId"], ("FAILURE",)),
                120,
            )
            wait_for("the input after the kill in every sink", lambda: _all_in(probe), 600, 1)

            dev.stop_sensor(f"{JOB}_new_data_sensor")
            dev.stop_sensor(f"{JOB}_failure_sensor")
            runs = dev.runs()
            jobs = {r["jobName"] for r in runs}
            assert FOLLOW_JOB in jobs and RUN_JOB in jobs, runs
            assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        if (tmp_path / "dagster_dev.log").exists():
            shutil.copy(tmp_path / "dagster_dev.log", ARTIFACTS / "follow_dagster_dev.log")
        raise
