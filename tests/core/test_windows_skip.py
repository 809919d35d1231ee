"""`onceflow windows skip`: an operator gives up a pending window whose input is gone; the
skip is recorded with its reason, shown everywhere, and later windows run exactly."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import psycopg
import pytest

from onceflow import ops
from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.reconcile import format_report, reconcile
from onceflow.registry import get_job
from onceflow.settings import Settings
from onceflow.status import open_items
from tests.support.cli import RUN_TIMEOUT_S, CliRun, Finished, cli_env, jobs_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.staged_payments import STAGED_PAYMENTS_PG_FIRST

pytestmark = pytest.mark.slow


class Site:
    def __init__(self, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path) -> None:
        self.settings = Settings(
            home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing
        )
        source = tmp_path / "input"
        generate_payments(
            source, records=1600, files=8, duplicate_rate=0.2, invalid_rate=0.05, seed=3
        )
        self.files = sorted((source / "payments").iterdir())
        (landing / "payments").mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_path

    def land(self, *indexes: int) -> None:
        for i in indexes:
            shutil.copy2(
                self.files[i], self.settings.landing.path / "payments" / self.files[i].name
            )

    def cli(self, *args: str, fault: str | None = None, **extra: str) -> Finished:
        return self.start(*args, fault=fault, **extra).finish()

    def start(self, *args: str, fault: str | None = None, **extra: str) -> CliRun:
        settings = self.settings
        env = cli_env(
            home=settings.home,
            dsn=str(settings.postgres_dsn),
            lake=settings.lake,
            landing=settings.landing,
            fault=fault,
            **extra,
        )
        return CliRun(list(args), env, self.tmp / "logs")

    def run(self, fault: str | None = None) -> Finished:
        return self.cli("run", "payments", "--max-files-per-window", "2", fault=fault)

    def run_in_process(self, spark) -> None:
        """A run that only sets the scene or closes it, in this process on the session's Spark
        (no JVM start of its own); it raises if the run fails."""
        ops.run(
            "payments",
            self.settings,
            spark=spark,
            dsn=str(self.settings.postgres_dsn),
            max_units_per_window=2,
        )

    def expected_without(self, *indexes: int):
        kept = self.tmp / "kept"
        shutil.rmtree(kept, ignore_errors=True)
        (kept / "payments").mkdir(parents=True)
        for i, path in enumerate(self.files):
            if i not in indexes and (self.settings.landing.path / "payments" / path.name).exists():
                shutil.copy2(path, kept / "payments" / path.name)
        return expected_outputs(kept)


def test_a_pending_window_whose_input_is_gone_is_skipped_with_its_reason(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    site = Site(pg_dsn, tmp_path, lake, landing)
    site.land(0, 1, 2, 3)
    site.run_in_process(spark)  # windows 1-2
    site.land(4, 5)
    crashed = site.run(fault="before_sinks@3")  # window 3 planned and written, no sink has it
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    # Its input is lost upstream (payments is deterministic: nothing of it is staged to replay).
    (landing / "payments" / site.files[4].name).unlink()
    assert not (lake / "_onceflow" / "staging").exists()

    blocked = site.run()
    assert blocked.returncode != 0
    assert site.files[4].name in blocked.stderr

    no_reason = site.cli("windows", "skip", "payments", "3", "--reason", " ")
    assert no_reason.returncode != 0 and "--reason" in no_reason.stderr
    skipped = site.cli("windows", "skip", "payments", "3", "--reason", "file lost upstream")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "windows 3 of payments skipped: file lost upstream" in skipped.stdout

    site.land(6, 7)
    site.run_in_process(spark)
    assert_exact(site.expected_without(4, 5), actual_outputs(pg_dsn, lake))

    status = site.cli("status", "payments")
    assert "window 3 skipped: file lost upstream" in status.stdout
    assert "pending none" in status.stdout
    engine = Engine(get_job("payments"), site.settings, spark, pg_dsn)
    assert open_items(engine).skipped == ((3, "file lost upstream"),)
    report = reconcile(engine)
    assert report.skipped == [(3, "file lost upstream")]
    assert report.clean, format_report(report)
    assert "window 3: skipped by an operator (file lost upstream)" in format_report(report)
    assert_exact(site.expected_without(4, 5), actual_outputs(pg_dsn, lake))

    # Completed windows are not for skipping: restate them.
    done = site.cli("windows", "skip", "payments", "2", "--reason", "no")
    assert done.returncode != 0 and "only pending windows" in done.stderr


def test_a_window_some_sink_holds_cannot_be_skipped(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    site = Site(pg_dsn, tmp_path, lake, landing)
    site.land(0, 1, 2, 3)
    crashed = site.run(fault="after_delta@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    refused = site.cli("windows", "skip", "payments", "2", "--reason", "try")
    assert refused.returncode != 0
    assert "window 2 is held by lake_payments" in refused.stderr
    site.run_in_process(spark)
    assert_exact(site.expected_without(), actual_outputs(pg_dsn, lake))


def test_a_stage_made_against_a_window_skipped_since_is_computed_again(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """A staged window whose dedupe saw an earlier window's keys is not reused once that
    window is skipped: its records that repeat the skipped window's are first occurrences now."""
    site = Site(pg_dsn, tmp_path, lake, landing)
    site.land(0, 1, 2, 3)
    jobs = jobs_env("tests.support.staged_payments:STAGED_PAYMENTS_PG_FIRST")
    Engine(STAGED_PAYMENTS_PG_FIRST, site.settings, None, pg_dsn).prepare()
    # A writer's lock holds window 1's PostgreSQL commit (its first) from outside, so no sink
    # holds window 1 while window 2 is computed beside it, deduplicated against window 1's
    # staged keys, and staged.
    hold = psycopg.connect(pg_dsn)
    hold.execute("LOCK TABLE public.payments IN SHARE MODE")
    run = site.start("run", "payments", "--max-files-per-window", "2", **jobs)
    try:
        stages = lake / "_onceflow" / "staging" / "payments"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not list(stages.glob("w0000000002-*/_COMPLETE.json")):
            assert run.proc.poll() is None, run.stderr()[-2000:]
            assert time.monotonic() < deadline, "window 2 was never staged"
            time.sleep(0.5)
        run.kill_group()
        run.finish()
    finally:
        run.kill_group()
        hold.rollback()
        hold.close()
    # Window 1's input is lost upstream; the operator gives it up.
    for i in (0, 1):
        (landing / "payments" / site.files[i].name).unlink()
    skipped = site.cli("windows", "skip", "payments", "1", "--reason", "lost upstream", **jobs)
    assert skipped.returncode == 0, skipped.stderr[-2000:]

    after = site.cli("run", "payments", "--max-files-per-window", "2", **jobs)
    assert after.returncode == 0, after.stderr[-2000:]
    assert_exact(site.expected_without(0, 1), actual_outputs(pg_dsn, lake))
