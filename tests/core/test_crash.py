"""Crash recovery with real processes and real signals: fault points, zombies, random kills."""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql

from onceflow import ops
from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.ops import EXIT_RETRYABLE
from onceflow.registry import get_job
from onceflow.settings import Settings
from onceflow.sinks.postgres.commit import _staging_name
from tests.support.cli import RUN_TIMEOUT_S, CliRun, Finished, cli_env, jobs_env
from tests.support.matrix import points
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.payment_log import JOB as PAYMENT_LOG_JOB

pytestmark = pytest.mark.slow


@dataclass
class Site:
    """One job installation: its database, lake, landing folder and home."""

    dsn: str
    lake: Path
    landing: Path
    home: Path

    def env(self, fault: str | None = None, **extra: str) -> dict[str, str]:
        return cli_env(
            home=self.home, dsn=self.dsn, lake=self.lake, landing=self.landing, fault=fault, **extra
        )

    def start(self, fault: str | None = None, max_files: int = 2, **extra: str) -> CliRun:
        args = ["run", "payments", "--max-files-per-window", str(max_files)]
        return CliRun(args, self.env(fault, **extra), self.home / "logs")

    def run(self, fault: str | None = None, max_files: int = 2) -> Finished:
        return self.start(fault, max_files).finish()

    def cli(self, *args: str, fault: str | None = None, **extra: str) -> CliRun:
        return CliRun(list(args), self.env(fault, **extra), self.home / "logs")

    def settings(self) -> Settings:
        return Settings(home=self.home, postgres_dsn=self.dsn, lake=self.lake, landing=self.landing)

    def run_in_process(self, spark: Any, max_files: int = 2, job: Any = PAYMENTS) -> None:
        """A run after the crash, in this process on the session's Spark (`ops.run`, what the
        CLI's `run` presents): no second JVM start. It raises if the run fails."""
        ops.run(job, self.settings(), spark=spark, dsn=self.dsn, max_units_per_window=max_files)

    def prepare_tables(self) -> None:
        """Create the job's tables and the ledger, as a run's start does (no Spark)."""
        Engine(get_job("payments"), self.settings(), None, self.dsn).prepare()

    def assert_exact(self) -> None:
        assert_exact(expected_outputs(self.landing), actual_outputs(self.dsn, self.lake))


@pytest.fixture(scope="module")
def input_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small input, generated once and copied into each test's landing folder."""
    root = tmp_path_factory.mktemp("input")
    generate_payments(root, records=3000, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    return root / "payments"


@pytest.fixture()
def site(pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, input_files: Path) -> Site:
    shutil.copytree(input_files, landing / "payments")
    home = tmp_path / "home"
    home.mkdir()
    return Site(pg_dsn, lake, landing, home)


# Every point of a window's path, once, on the local deployment (S3, Spark Connect and the
# cluster run a representative point each: test_s3_lake.py, test_spark_server.py,
# test_spark_cluster.py). The crash is a real `onceflow` process killed at the point; the run
# after it is in this process on the session's Spark (the CLI's own rerun after a crash:
# test_cli.py, test_spark_server.py).
@pytest.mark.parametrize(
    "point", ("plan", "before_sinks", "after_delta", "pg_commit_sent", "after_commits")
)
def test_crash_at_fault_point_then_rerun_is_exact(spark: Any, site: Site, point: str) -> None:
    crashed = site.run(fault=f"{point}@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert f"fault injected at {point} (window 2)" in crashed.stderr

    site.run_in_process(spark)
    site.assert_exact()


def _wait_stopped(run: CliRun, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    proc = psutil.Process(run.pid)
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            pytest.fail(f"the zombie exited ({run.proc.returncode}) before it froze")
        if proc.status() == psutil.STATUS_STOPPED:
            return
        time.sleep(0.5)
    run.kill_group()
    pytest.fail("the run never froze at its fault point")


def _within(timeout: float, call: Callable[[], object]) -> None:
    """`call()` in a thread: it must return within `timeout` (a hang fails the test, not the
    session) and not raise."""
    failed: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test thread
            failed.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"did not return within {timeout}s")
    if failed:
        raise failed[0]


def test_frozen_zombie_is_fenced_and_writes_nothing(spark: Any, site: Site) -> None:
    zombie = site.start(fault="before_pg_commit@2:stop")
    try:
        _wait_stopped(zombie, RUN_TIMEOUT_S)
        # It froze inside its PG transaction holding the job row lock: the newer run must
        # end its sessions rather than wait forever. The newer run in this process (the
        # zombie is the process under test).
        _within(RUN_TIMEOUT_S, lambda: site.run_in_process(spark))
        site.assert_exact()
        before = actual_outputs(site.dsn, site.lake)

        os.kill(zombie.pid, signal.SIGCONT)
        woken = zombie.finish()
    finally:
        zombie.kill_group()
    assert woken.returncode == 3, (woken.returncode, woken.stderr[-2000:])
    assert "fenced" in woken.stderr
    after = actual_outputs(site.dsn, site.lake)
    assert sorted(after.delta_payments) == sorted(before.delta_payments)
    assert sorted(after.pg_payments) == sorted(before.pg_payments)
    assert sorted(after.balances) == sorted(before.balances)
    site.assert_exact()


def _crash_restart_server(dsn: str) -> None:
    """Crash one server process from outside: the postmaster ends every session, runs crash
    recovery (which empties UNLOGGED tables) and accepts connections again."""
    victim = psycopg.connect(dsn, autocommit=True)
    pid = victim.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    time.sleep(1)
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        finally:
            victim.close()


def _staged_rows(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        names = [
            n
            for (n,) in conn.execute(
                "SELECT relname FROM pg_class WHERE relpersistence = 'u'"
                " AND relnamespace = 'onceflow'::regnamespace AND relkind = 'r'"
            )
        ]
        return {
            n: conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("onceflow", n))
            ).fetchone()[0]  # type: ignore[index]
            for n in names
        }


def test_server_crash_restart_between_staging_and_apply_restages(site: Site) -> None:
    run = site.start(fault="pg_staged@2:stop")
    try:
        _wait_stopped(run, RUN_TIMEOUT_S)
        before = _staged_rows(site.dsn)
        assert before and all(rows > 0 for rows in before.values()), before
        _crash_restart_server(site.dsn)
        after = _staged_rows(site.dsn)
        assert after == {name: 0 for name in before}, after  # the restart emptied them
        os.kill(run.pid, signal.SIGCONT)
        finished = run.finish()
    finally:
        run.kill_group()
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "staging again" in finished.stderr
    site.assert_exact()


# A job whose outputs are staged (Parquet under the lake) before they are committed.
STAGED = jobs_env("tests.support.staged_payments:STAGED_PAYMENTS")


def test_server_crash_restart_between_key_staging_and_the_next_lookups_is_exact(
    site: Site,
) -> None:
    # Window 2 starts its commit with its keys staged; window 3 is prepared beside it and has
    # not looked them up yet.
    run = site.start(fault="before_sinks@2:stop", **STAGED)
    try:
        _wait_stopped(run, RUN_TIMEOUT_S)
        staged = _staged_rows(site.dsn)
        assert any(n.startswith("keys_") and rows for n, rows in staged.items()), staged
        _crash_restart_server(site.dsn)
        assert all(rows == 0 for rows in _staged_rows(site.dsn).values())
        os.kill(run.pid, signal.SIGCONT)
        # Window 3's lookups find window 2's keys neither staged nor in the index: its
        # stage, made against window 1 only, must not be what is committed.
        finished = run.finish()
    finally:
        run.kill_group()
    assert finished.returncode == 0, finished.stderr[-2000:]
    site.assert_exact()


def _sorted_outputs(site: Site) -> list[list[object]]:
    actual = actual_outputs(site.dsn, site.lake)
    parts: list[list[object]] = [
        sorted(actual.delta_payments),
        sorted(actual.pg_payments),
        sorted(actual.balances),
        sorted(actual.quarantine, key=repr),
    ]
    return parts


def test_a_zombie_paused_while_staging_keys_writes_nothing(site: Site) -> None:
    # One window. The zombie made its key staging table and froze before copying its keys.
    zombie = site.start(fault="keys_staging@1:stop", max_files=10)
    newer: CliRun | None = None
    try:
        _wait_stopped(zombie, RUN_TIMEOUT_S)
        # A newer run takes over and stages the same window's keys, then pauses before
        # committing it: what it staged is what its commit will count and index.
        newer = site.start(fault="before_sinks@1:stop", max_files=10)
        _wait_stopped(newer, RUN_TIMEOUT_S)
        before = _staged_rows(site.dsn)
        assert any(n.startswith("keys_") and rows for n, rows in before.items()), before
        outputs = _sorted_outputs(site)

        os.kill(zombie.pid, signal.SIGCONT)
        woken = zombie.finish()
        assert woken.returncode == 3, (woken.returncode, woken.stderr[-2000:])
        assert "fenced" in woken.stderr
        after = _staged_rows(site.dsn)
        # Nothing the newer run staged was emptied, refilled or dropped, and the zombie copied
        # nothing anywhere (its own tables, empty, may be gone).
        assert {n: r for n, r in before.items() if r} == {n: r for n, r in after.items() if r}
        assert all(before.get(n) == r for n, r in after.items()), (before, after)
        assert _sorted_outputs(site) == outputs

        os.kill(newer.pid, signal.SIGCONT)
        finished = newer.finish()
    finally:
        zombie.kill_group()
        if newer is not None:
            newer.kill_group()
    assert finished.returncode == 0, finished.stderr[-2000:]
    site.assert_exact()


def _wait_for_lock_wait(dsn: str, table: str, timeout: float) -> None:
    """Until a session of the job waits for a lock in a statement on `table`."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'onceflow/payments/e%%'"
                " AND wait_event_type = 'Lock' AND query LIKE %s",
                (f"%{table}%",),
            ).fetchone()
            if row is not None:
                return
            time.sleep(0.2)
    pytest.fail(f"no session of the run waited on {table}")


def test_a_copy_committed_between_the_count_and_the_apply_is_not_applied(site: Site) -> None:
    site.prepare_tables()
    # A writer's lock on the balances table holds the window's commit between its count of
    # the balances' staging table and the apply that reads it.
    hold = psycopg.connect(site.dsn)
    hold.execute("LOCK TABLE public.merchant_balances IN SHARE MODE")
    run = site.start()
    try:
        _wait_for_lock_wait(site.dsn, "merchant_balances", RUN_TIMEOUT_S)
        with psycopg.connect(site.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT epoch FROM onceflow.jobs WHERE job = 'payments'").fetchone()
        assert row is not None
        staging = sql.Identifier(
            "onceflow", _staging_name("payments", "pg_merchant_balances", 1, int(row[0]), "w")
        )
        # A stale task attempt's COPY of the same rows commits now, from a session of its own.
        with psycopg.connect(site.dsn) as stale:
            stale.execute("SET lock_timeout = '3s'")
            try:
                stale.execute(sql.SQL("INSERT INTO {} SELECT * FROM {}").format(staging, staging))
                stale.commit()
                landed = True
            except psycopg.errors.LockNotAvailable:
                stale.rollback()
                landed = False  # refused: the apply holds what it counted
        print(f"the stale copy {'landed' if landed else 'was refused'}")
        hold.rollback()
        finished = run.finish()
    finally:
        hold.close()
        run.kill_group()
    assert finished.returncode == 0, finished.stderr[-2000:]
    site.assert_exact()


# The payments job with a keyless append sink, `pg_payment_log`.
PAYMENT_LOG = jobs_env("tests.support.payment_log:JOB")


def _payment_log(dsn: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """The log's rows, and the rows it should hold (each payment once)."""
    with psycopg.connect(dsn) as conn:
        log = conn.execute("SELECT payment_id, amount_cents, _window_id FROM payment_log")
        want = conn.execute("SELECT payment_id, amount_cents, _window_id FROM public.payments")
        return sorted(log.fetchall()), sorted(want.fetchall())


def test_a_repair_copy_staged_twice_is_staged_again_not_applied_twice(
    spark: Any, site: Site
) -> None:
    # The run before the damage, in-process: only the repair is the process under test.
    site.run_in_process(spark, job=PAYMENT_LOG_JOB)
    log, want = _payment_log(site.dsn)
    assert log == want and len(want) > 100
    with psycopg.connect(site.dsn) as conn:
        conn.execute(
            "DELETE FROM payment_log WHERE payment_id IN"
            " (SELECT payment_id FROM payment_log ORDER BY payment_id LIMIT 5)"
        )

    repair = site.cli("reconcile", "payments", fault="repair_staged:stop", **PAYMENT_LOG)
    try:
        _wait_stopped(repair, RUN_TIMEOUT_S)
        # The executors copied the 5 rows to insert; a retried task's COPY of the same rows
        # commits too (a session of its own, as the task's would be).
        with psycopg.connect(site.dsn) as conn:
            (name,) = [
                n
                for (n,) in conn.execute(
                    "SELECT relname FROM pg_class WHERE relnamespace = 'onceflow'::regnamespace"
                    " AND relname LIKE 'reconcile%%ins%%'"
                )
            ]
            staging = sql.Identifier("onceflow", name)
            rows = conn.execute(sql.SQL("SELECT * FROM {}").format(staging)).fetchall()
            assert len(rows) == 5
            with conn.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(staging)) as copy:
                for row in rows:
                    copy.write_row(row)
        os.kill(repair.pid, signal.SIGCONT)
        finished = repair.finish()
    finally:
        repair.kill_group()
    assert finished.returncode == 0, finished.stderr[-2000:]
    log, want = _payment_log(site.dsn)
    assert len(log) == len(want), f"{len(log) - len(want)} rows doubled"
    assert log == want
    site.assert_exact()


def _drop_plan(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM onceflow.windows WHERE job = 'payments'")
        conn.execute("DELETE FROM onceflow.source_units WHERE job = 'payments'")


@pytest.mark.parametrize(
    "point",
    points(
        *("plan", "before_sinks", "after_delta", "pg_staged", "pg_commit_sent", "after_commits"),
        in_ci=("pg_staged",),
    ),
)
def test_plan_lost_after_a_crash_then_another_window_size_is_exact(
    spark: Any, site: Site, point: str
) -> None:
    crashed = site.run(fault=f"{point}@2", max_files=2)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    _drop_plan(site.dsn)  # stages of the old plan stay in the lake
    site.run_in_process(spark, max_files=3)
    site.assert_exact()


def _seeds() -> Iterator[int]:
    seed = int(os.environ.get("ONCEFLOW_KILL_SEED", time.time_ns() % 10_000))
    print(f"kill loop seed: {seed} (set ONCEFLOW_KILL_SEED to replay)")
    yield seed


def _killed_at_random(
    site: Site, runs: int, max_files: int, delays: tuple[float, float], **env: str
) -> list[tuple[float, int | None]]:
    """`runs` CLI runs (with `env`), each killed (driver and Spark JVM together) after a random
    delay in `delays` unless it ended first; (delay, returncode) of each."""
    rng = random.Random(next(_seeds()))
    outcomes = []
    for _ in range(runs):
        run = site.start(max_files=max_files, **env)
        delay = rng.uniform(*delays)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.2)
        run.kill_group()
        result = run.finish(timeout=60)
        outcomes.append((round(delay, 1), result.returncode))
        assert result.returncode in (0, -signal.SIGKILL), result.stderr[-2000:]
    print(f"kills (delay s, returncode): {outcomes}")
    return outcomes


def test_random_kills_then_clean_run_is_exact(spark: Any, site: Site) -> None:
    _killed_at_random(site, runs=5, max_files=1, delays=(3, 25))
    site.run_in_process(spark, max_files=1)
    site.assert_exact()


@pytest.mark.exhaustive
def test_large_windows_read_in_runs_killed_at_random_then_rerun_is_exact(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    """Windows over the one-task limit, read by a run of files a core with first occurrences
    compared across the runs (a `local[4]` session gives a window's read two cores), under
    the same random kills; the rerun on 2 cores reads each window by one task."""
    from onceflow.sources.landing import ONE_TASK_MAX_BYTES

    generate_payments(landing, records=400_000, files=40, duplicate_rate=0.1, invalid_rate=0.02)
    files = sorted((landing / "payments").iterdir())
    assert sum(f.stat().st_size for f in files[:10]) > ONE_TASK_MAX_BYTES
    home = tmp_path / "home"
    home.mkdir()
    site = Site(pg_dsn, lake, landing, home)
    outcomes = _killed_at_random(
        site, runs=4, max_files=10, delays=(6, 16), ONCEFLOW_SPARK_MASTER="local[4]"
    )
    # A run of four such windows outlasts the first delay: at least that run died mid-way.
    assert any(code == -signal.SIGKILL for _, code in outcomes)
    site.run_in_process(spark, max_files=10)
    site.assert_exact()


# -- bad configuration: fails before Spark starts ------------------------------------------------


def _assert_one_paragraph(result: Finished, code: int = 1) -> str:
    text = (result.stdout + result.stderr).strip()
    assert result.returncode == code, text[-2000:]
    assert "Traceback" not in text
    assert "\n\n" not in text
    assert text.startswith("onceflow:"), text
    return text


def test_unreachable_database_fails_cleanly_without_leaking_the_password(site: Site) -> None:
    env = site.env(ONCEFLOW_POSTGRES_DSN="postgresql://u:secret@127.0.0.1:1/db")
    result = CliRun(["run", "payments"], env, site.home / "logs").finish(timeout=120)
    text = _assert_one_paragraph(result, EXIT_RETRYABLE)  # the same command may pass later
    assert "secret" not in text
    assert "PostgreSQL" in text


def test_missing_landing_folder_is_reported(site: Site, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-landing"
    env = site.env(ONCEFLOW_LANDING=str(missing))
    result = CliRun(["run", "payments"], env, site.home / "logs").finish(timeout=120)
    text = _assert_one_paragraph(result)
    assert str(missing) in text and "landing" in text


def test_unwritable_lake_is_reported(site: Site, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    env = site.env(ONCEFLOW_LAKE=str(blocker / "lake"))
    result = CliRun(["run", "payments"], env, site.home / "logs").finish(timeout=120)
    text = _assert_one_paragraph(result)
    assert "ONCEFLOW_LAKE" in text and str(blocker / "lake") in text
