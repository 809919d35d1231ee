"""Under a real `dagster dev`, run workers killed mid-run never block payments.

The shipped `dagster.yaml` (copied unchanged into a fresh `DAGSTER_HOME`) is the instance under
test. The new-data sensor launches a payments run; the test SIGKILLs its run worker, then the
run worker of each of its automatic retries (`run_retries.max_retries: 2`), so the retry chain
ends with a retry that also died. The job must get out of that on its own: the failure sensor
launches the recovery job, which replays the window the first run planned and commits the input
that landed while the job was down, with every sink exact against the plain-Python oracle, and
no run left queued behind the pool slot a dead worker held (pool `onceflow_payments`, limit 1).

What is killed: a machine loss, not a polite stop. The run worker (a process the code server
spawns per run, in which the run job's steps execute) and its Spark JVM are frozen together
(SIGSTOP, so nothing is spawned or written meanwhile) and then SIGKILLed together; the code
server, the daemon and PostgreSQL live on, as they would on other machines. Every process of
the run dies; an orphan that finishes its window by itself is a zombie the engine's epochs
fence, which the core's crash tests cover.

When it kills: the first run once it has planned a window (the ledger holds a pending window,
so its retry has something to replay); each retry once its engine has taken a new epoch (it is
replaying). Both are observed from outside, through the ledger, as an operator would see them.

The sensors run as shipped, with two exceptions: daily_totals' new-data sensor is stopped (its
Spark runs are load, not subject), and payments' new-data sensor is stopped before the last
kill, so that the failure sensor's recovery is what must bring the job back (see
`kill_run_and_retries`). Until then it runs, and must leave the work to Dagster's retries.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from onceflow.engine import Engine, build_engine
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.settings import Settings
from onceflow.status import pending_work
from tests.support.dagster_dev import (
    FINISHED,
    ROOT,
    DagsterDev,
    dagster_dev_env,
    running_dagster_dev,
    wait_for,
)
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(1800)]

ARTIFACTS = ROOT / "tests" / "artifacts" / "run_worker_killed"
JOB = "payments"
RUN_JOB = f"{JOB}_job"
RECOVERY_JOB = f"{JOB}_recovery_job"
POOL = f"onceflow_{JOB}"
# The first run and both of its retries (dagster.yaml: run_retries.max_retries 2).
KILLS = 3
IN_FLIGHT = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")
# Bounds, generous for a 2-core machine shared with other Spark tests: a run's start is a fresh
# process importing the definitions, its step another one starting a Spark JVM.
LAUNCH_TIMEOUT_S = 240  # a request or retry until its run worker runs (slot freed, dequeued)
ENGINE_TIMEOUT_S = 240  # a started run until its engine planned or took an epoch
DEATH_TIMEOUT_S = 60  # a killed worker until its run is FAILURE
RECOVERY_TIMEOUT_S = 600  # the last death until the failure sensor's recovery succeeded
SETTLE_TIMEOUT_S = 420  # then until no run of the instance is queued or running
PID_MESSAGE = re.compile(r"Started process for run \(pid: (\d+)\)")
REPLAYED = re.compile(r"^window (\d+): replayed$")


@dataclass
class Victim:
    """A run whose worker the test killed, and what the ledger held at that moment."""

    run_id: str
    processes: list[str]
    pending_windows: list[int]
    unplanned: int
    epoch: int
    last_window: int
    status_after: str = ""
    will_retry: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


class LedgerProbe:
    """Reads the payments ledger from outside Dagster: pending windows and the current epoch.

    Prepared before `dagster dev` starts, so its schema creation cannot race the sensors'.
    """

    def __init__(self, dsn: str, home: Path, lake: Path, landing: Path) -> None:
        settings = Settings(home=home, postgres_dsn=dsn, lake=lake, landing=landing)
        self.engine: Engine = build_engine(PAYMENTS, settings, None, dsn)
        self.engine.prepare()

    def pending_windows(self) -> list[int]:
        return list(pending_work(self.engine).pending_windows)

    def epoch(self) -> int:
        return self.engine.ledger.current_epoch() or 0


def run_worker(dev: DagsterDev, run_id: str) -> psutil.Process:
    """The run's worker process: the pid its `Started process for run` event names, checked to
    be a process under this `dagster dev` (not a reused pid)."""

    def pid() -> int | None:
        for event in dev.run_messages(run_id):
            found = PID_MESSAGE.search(event["message"] or "")
            if found:
                return int(found.group(1))
        return None

    worker = psutil.Process(wait_for(f"the worker pid of run {run_id}", pid, 60, 0.5))
    assert dev.proc.pid in {p.pid for p in worker.parents()}, (
        f"pid {worker.pid} of run {run_id} is not under dagster dev"
    )
    return worker


def kill_tree(root: psutil.Process) -> dict[int, str]:
    """Freeze `root` and every descendant, then SIGKILL them all: a machine loss for the run.

    Frozen first so no child is spawned between listing the tree and killing it. Returns the
    killed processes' names by pid.
    """
    frozen: dict[int, psutil.Process] = {}
    names: dict[int, str] = {}
    while True:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        fresh = [p for p in tree if p.pid not in frozen]
        if not fresh:
            break
        for proc in fresh:
            frozen[proc.pid] = proc
            names[proc.pid] = _name(proc)
            _signal(proc, signal.SIGSTOP)
    assert root.pid in frozen, f"run worker {root.pid} was gone before the kill"
    for proc in frozen.values():
        _signal(proc, signal.SIGKILL)
    procs = list(frozen.values())
    # Dead or a zombie (its parent reaps it; the worker's is the code server) is dead enough.
    wait_for(
        "the killed processes to die",
        lambda: all(_status(p) in (None, psutil.STATUS_ZOMBIE) for p in procs),
        30,
        0.1,
    )
    return names


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "?"


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.NoSuchProcess:
        return None


def wait_run(
    dev: DagsterDev, what: str, find: Callable[[list[dict[str, Any]]], Any], timeout_s: float
) -> Any:
    """Poll the instance's runs until `find` picks something out of them."""
    return wait_for(what, lambda: find(dev.runs()), timeout_s, 1)


def status_of(run_id: str, statuses: tuple[str, ...]) -> Callable[..., Any]:
    def find(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in runs if r["runId"] == run_id and r["status"] in statuses), None)

    return find


def retry_of(run_id: str) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    """Dagster's automatic retry of `run_id` (a re-execution carrying `dagster/retry_number`)."""

    def find(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next(
            (r for r in runs if r["parentRunId"] == run_id and "dagster/retry_number" in r["tags"]),
            None,
        )

    return find


def recovery_of(run_id: str) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    """The failure sensor's recovery run for `run_id`, once it has ended."""

    def find(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in runs
                if r["jobName"] == RECOVERY_JOB
                and r["tags"].get("onceflow/failed_run_id") == run_id
                and r["status"] in FINISHED
            ),
            None,
        )

    return find


def engine_at_work(probe: LedgerProbe, previous: Victim | None) -> tuple[Callable[[], bool], str]:
    """When a run's engine is at work, seen in the ledger: the first run has planned a window;
    a retry has taken an epoch above its dead parent's (it is replaying what that one left).
    One payments run at a time: an epoch taken while the retry runs is the retry's."""
    if previous is None:
        return (lambda: bool(probe.pending_windows())), "a window planned"
    return (lambda: probe.epoch() > previous.epoch), f"an epoch above {previous.epoch} taken"


def kill_when_at_work(
    dev: DagsterDev, run_id: str, probe: LedgerProbe, previous: Victim | None
) -> Victim:
    """Wait until the run is STARTED and its engine at work, then kill the run's process tree."""
    started = wait_run(
        dev,
        f"run {run_id} to start",
        status_of(run_id, ("STARTED", *FINISHED)),
        LAUNCH_TIMEOUT_S,
    )
    assert started["status"] == "STARTED", started
    worker = run_worker(dev, run_id)
    ready, what = engine_at_work(probe, previous)

    def still_running_and_ready() -> bool:
        status = dev.run(run_id)["status"]
        assert status == "STARTED", f"run {run_id} is {status} before it could be killed"
        return ready()

    wait_for(f"run {run_id}: {what}", still_running_and_ready, ENGINE_TIMEOUT_S, 0.2)
    killed = kill_tree(worker)
    # The step was at work: its process and its Spark JVM died with the worker.
    assert "java" in killed.values(), killed
    work = pending_work(probe.engine)
    return Victim(
        run_id,
        sorted(f"{pid} {name}" for pid, name in killed.items()),
        list(work.pending_windows),
        work.unplanned,
        probe.epoch(),
        probe.engine.ledger.last_window_id(),
    )


def record_death(dev: DagsterDev, victim: Victim) -> None:
    """Wait for the killed run to end, and note how (Dagster's `will_retry` verdict).

    Dagster stores a failure first and tags its verdict just after; both are waited for.
    """
    ended = status_of(victim.run_id, FINISHED)

    def judged(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
        run = ended(runs)
        if run and run["status"] == "FAILURE" and "dagster/will_retry" not in run["tags"]:
            return None
        return run

    dead = wait_run(dev, f"killed run {victim.run_id} to end", judged, DEATH_TIMEOUT_S)
    victim.status_after = dead["status"]
    victim.tags = dead["tags"]
    victim.will_retry = dead["tags"].get("dagster/will_retry")


def kill_run_and_retries(
    dev: DagsterDev, first_run_id: str, probe: LedgerProbe, landing: Path, victims: list[Victim]
) -> None:
    """Kill the first run and each automatic retry of it while its engine is at work.

    Before the last kill the new-data sensor is stopped: from then on only the failure sensor's
    recovery can bring the job back, so that is what the test checks. (Left on, it requests a
    run for the pending work too, which may get there first; either is the job recovering on
    its own, but only this way is the recovery's part checked.)
    """
    run_id = first_run_id
    for number in range(KILLS):
        if number == KILLS - 1:
            dev.stop_sensor(f"{JOB}_new_data_sensor")
        victim = kill_when_at_work(dev, run_id, probe, victims[-1] if victims else None)
        victims.append(victim)
        if number == 0:
            # Lands while the job is down: input no window has planned yet.
            land(landing, seed=12)
        record_death(dev, victim)
        assert victim.status_after == "FAILURE", victim
        if number == KILLS - 1:
            assert victim.will_retry == "false", victim  # retries used up: recovery's turn
            return
        assert victim.will_retry == "true", victim
        retry = wait_run(dev, f"the retry of {run_id}", retry_of(run_id), LAUNCH_TIMEOUT_S)
        assert retry["tags"]["dagster/retry_number"] == str(number + 1), retry["tags"]
        assert retry["rootRunId"] == first_run_id, retry
        run_id = retry["runId"]


def replayed_windows(dev: DagsterDev, run_id: str) -> set[int]:
    """Windows a recovery run committed, from its log (`window N: replayed`)."""
    found = (REPLAYED.search(e["message"] or "") for e in dev.run_messages(run_id))
    return {int(m.group(1)) for m in found if m}


def land(landing: Path, seed: int) -> None:
    generate_payments(
        landing, records=4000, files=3, duplicate_rate=0.05, invalid_rate=0.02, seed=seed
    )


@contextmanager
def evidence_on_failure(dev: DagsterDev, victims: list[Victim]) -> Iterator[None]:
    """On failure, leave the dagster dev log, every run's events and the kills in
    `tests/artifacts/run_worker_killed/`."""
    try:
        yield
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "victims.json").write_text(json.dumps([asdict(v) for v in victims], indent=2))
        try:
            runs = dev.runs()
            (ARTIFACTS / "runs.json").write_text(json.dumps(runs, indent=2))
            for run in runs:
                lines = [
                    f"{e['type']} {e['stepKey'] or '-'} {e['message']}"
                    for e in dev.run_messages(run["runId"])
                ]
                name = f"{run['jobName']}_{run['runId'][:8]}_{run['status']}.log"
                (ARTIFACTS / name).write_text("\n".join(lines))
        except Exception as exc:  # the evidence must not hide the failure
            (ARTIFACTS / "runs_error.txt").write_text(repr(exc))
        shutil.copy(dev.log_path, ARTIFACTS / "dagster_dev.log")
        raise


def test_killed_run_workers_end_in_recovery_with_exact_outputs(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    probe = LedgerProbe(pg_dsn, tmp_path / "onceflow", lake, landing)
    env = dagster_dev_env(
        tmp_path / "dagster_home",
        pg_dsn=pg_dsn,
        lake=lake,
        landing=landing,
        onceflow_home=tmp_path / "onceflow",
        # Only shortens the wait for the first run; the instance config is the shipped one.
        # One run per batch of new input: its runs and their automatic retries are what is
        # killed here (the follow run's worker is killed in test_follow_dev.py).
        extra={"ONCEFLOW_SENSOR_INTERVAL_S": "5", "ONCEFLOW_DELIVERY": "runs"},
    )
    victims: list[Victim] = []
    with (
        running_dagster_dev(env, tmp_path / "dagster_dev.log") as dev,
        evidence_on_failure(dev, victims),
    ):
        for name in (f"{JOB}_new_data_sensor", f"{JOB}_failure_sensor"):
            dev.start_sensor(name)
        # daily_totals reads the payments table and would start a Spark run per payments commit:
        # load on a 2-core machine that has nothing to do with what is tested here.
        dev.stop_sensor("daily_totals_new_data_sensor")
        # The hourly reconcile schedules take epochs too: one firing on the hour while a retry
        # starts would pass for that retry's start. The failure sensor's recovery is tested here.
        for name in (f"{JOB}_reconcile_schedule", "daily_totals_reconcile_schedule"):
            dev.stop_schedule(name)
        assert dev.pool(POOL)["limit"] == 1, dev.pool(POOL)

        land(landing, seed=11)
        first = wait_run(
            dev,
            "a payments run from the new-data sensor",
            lambda runs: next((r for r in runs if r["jobName"] == RUN_JOB), None),
            LAUNCH_TIMEOUT_S,
        )
        assert first["tags"]["dagster/sensor_name"] == f"{JOB}_new_data_sensor"
        kill_run_and_retries(dev, first["runId"], probe, landing, victims)
        last = victims[-1]
        # The recovery has work to do: the dead runs left a window pending or input unplanned.
        assert last.pending_windows or last.unplanned, victims

        recovery = wait_run(
            dev,
            f"the failure sensor's recovery of {last.run_id}",
            recovery_of(last.run_id),
            RECOVERY_TIMEOUT_S,
        )
        assert recovery["status"] == "SUCCESS", recovery
        assert recovery["tags"]["dagster/sensor_name"] == f"{JOB}_failure_sensor"
        # It replayed what the dead runs left pending and committed the input that landed
        # while the job was down, in a window of its own.
        replayed = replayed_windows(dev, recovery["runId"])
        assert set(last.pending_windows) <= replayed, (replayed, victims)
        if last.unplanned:
            assert max(replayed, default=0) > last.last_window, (replayed, victims)

        # Nothing is left queued behind a slot a dead worker held: every run ends, bounded.
        runs = wait_run(
            dev,
            "every run of the instance to finish",
            lambda runs: runs if not any(r["status"] in IN_FLIGHT for r in runs) else None,
            SETTLE_TIMEOUT_S,
        )
        pool = dev.pool(POOL)
        assert pool["claimedSlots"] == [] and pool["pendingStepCount"] == 0, pool
        not_ok = sorted(r["runId"] for r in runs if r["status"] != "SUCCESS")
        assert not_ok == sorted(v.run_id for v in victims), [
            (r["jobName"], r["runId"], r["status"]) for r in runs
        ]

        work = pending_work(probe.engine)
        assert not work.pending_windows and not work.unplanned, work
        assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
        for victim in victims:
            print(
                f"killed {victim.run_id} ({len(victim.processes)} processes): pending windows "
                f"{victim.pending_windows}, {victim.unplanned} unplanned files, epoch {victim.epoch}"
            )
        print(f"recovered by {recovery['runId']}: replayed windows {sorted(replayed)}")
