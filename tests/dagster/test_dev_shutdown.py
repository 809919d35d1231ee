"""`make dev` stops cleanly: SIGTERM to `scripts/dev.sh`'s process group (what `make dev`
runs; Ctrl-C signals the same group) while a follow run commits a window ends the run after
that window, never retried, stops the Spark Connect server last, and leaves no process behind
within 60 s; the window is committed exactly once."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
from dagster import DagsterInstance, RunsFilter

from onceflow.generate import generate_payments
from onceflow.status import pending_work
from tests.dagster.test_run_worker_killed import ARTIFACTS, LedgerProbe, wait_run
from tests.support import dagster_dev
from tests.support.dagster_dev import (
    ROOT,
    dagster_dev_env,
    free_port,
    running_dagster_dev,
    wait_for,
)
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(1200)]

JOB = "payments"
FOLLOW_JOB = f"{JOB}_follow_job"
START_TIMEOUT_S = 300  # the Spark Connect server, then a sensor's follow run on it
DONE_TIMEOUT_S = 420
STOP_BOUND_S = 60


def _all_in(probe: LedgerProbe) -> bool:
    work = pending_work(probe.engine)
    return not work.unplanned and not work.pending_windows


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # ended meanwhile, or a zombie
        return ""


def _alive(procs: list[psutil.Process]) -> list[str]:
    """The processes of `procs` still running (a zombie has ended: only its entry is left)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {_cmdline(proc)[:120]}")
        except psutil.Error:
            pass
    return alive


def test_sigterm_to_make_dev_ends_follow_runs_after_their_window_and_stops_everything(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The webserver comes up after the Spark Connect server: a JVM start first.
    monkeypatch.setattr(dagster_dev, "SERVER_TIMEOUT_S", START_TIMEOUT_S)
    probe = LedgerProbe(pg_dsn, tmp_path / "onceflow", lake, landing)
    home = tmp_path / "dagster_home"
    env = dagster_dev_env(
        home,
        pg_dsn=pg_dsn,
        lake=lake,
        landing=landing,
        onceflow_home=tmp_path / "onceflow",
        extra={"ONCEFLOW_SENSOR_INTERVAL_S": "5", "ONCEFLOW_SPARK_PORT": str(free_port())},
    )
    env.pop("ONCEFLOW_SPARK_REMOTE", None)  # dev.sh starts its own server
    log = tmp_path / "dev.log"
    try:
        with running_dagster_dev(env, log, ["bash", str(ROOT / "scripts" / "dev.sh")]) as dev:
            dev.start_sensor(f"{JOB}_new_data_sensor")
            dev.start_sensor(f"{JOB}_failure_sensor")
            dev.stop_sensor("daily_totals_new_data_sensor")
            for name in (f"{JOB}_reconcile_schedule", "daily_totals_reconcile_schedule"):
                dev.stop_schedule(name)

            generate_payments(landing, records=2000, files=1, seed=31)
            follow = wait_run(
                dev,
                "the sensor's follow run",
                lambda runs: next(
                    (r for r in runs if r["jobName"] == FOLLOW_JOB and r["status"] == "STARTED"),
                    None,
                ),
                START_TIMEOUT_S,
            )
            wait_for("the first file in every sink", lambda: _all_in(probe), DONE_TIMEOUT_S, 1)
            # A large file: its window is planned, and SIGTERM comes while it is committed.
            generate_payments(landing, records=60000, files=1, seed=32)
            wait_for(
                "the second file's window planned",
                lambda: pending_work(probe.engine).pending_windows,
                DONE_TIMEOUT_S,
                0.1,
            )
            root = psutil.Process(dev.proc.pid)
            tree = [root, *root.children(recursive=True)]
            names = " ".join(_cmdline(p) for p in tree)
            assert "spark-server" in names and "dagster_webserver" in names, names
            os.killpg(dev.proc.pid, signal.SIGTERM)
            started = time.monotonic()
            while _alive(tree) and time.monotonic() - started < STOP_BOUND_S:
                time.sleep(0.5)
            stopped_s = time.monotonic() - started
            assert not _alive(tree), (stopped_s, _alive(tree))
            dev.proc.wait(timeout=5)
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        if log.exists():
            shutil.copy(log, ARTIFACTS / "dev_shutdown.log")
        spark_log = home / "logs" / "spark-server.log"
        if spark_log.exists():
            shutil.copy(spark_log, ARTIFACTS / "dev_shutdown_spark_server.log")
        raise

    # The window in progress was finished, once: nothing pending, every sink exact.
    assert _all_in(probe)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    # The follow run ended after its window, and nothing runs it again: no retry, no recovery.
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_run_by_id(follow["runId"])
        assert run is not None
        assert run.tags.get("onceflow/follow_end") == "interrupted", (run.status, run.tags)
        assert run.tags.get("dagster/will_retry") != "true", run.tags
        others = instance.get_run_records(RunsFilter(job_name=FOLLOW_JOB))
        assert [r.dagster_run.run_id for r in others] == [follow["runId"]]
        assert not instance.get_run_records(RunsFilter(tags={"onceflow/failed_run_id": run.run_id}))
        steps = [
            e.dagster_event.event_type_value
            for e in instance.all_logs(run.run_id)
            if e.dagster_event is not None and e.dagster_event.step_key
        ]
        assert "STEP_UP_FOR_RETRY" not in steps, steps
    print(f"stopped in {stopped_s:.1f}s; follow run {run.status.value}")
