"""Ledger rows removed under a live `run --follow` (by hand, by a restore, by another tool): the
run notices before it plans again (`JobContext.ledger_changed`), checks the ledger as a
start-up does and rebuilds what was removed, so input the removed rows recorded as taken is
never taken again. The job has no dedupe: the unit index is its only guard."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from onceflow.generate import generate_payments
from tests.support.cli import cli_env
from tests.support.follow import wait_completed, windows
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "removal",
    [
        "DELETE FROM onceflow.source_units WHERE job = 'payments' AND window_id <= 2",
        pytest.param("TRUNCATE onceflow.source_units", marks=pytest.mark.exhaustive),
        pytest.param(
            "DELETE FROM onceflow.windows WHERE job = 'payments' AND window_id = 1;"
            " DELETE FROM onceflow.source_units WHERE job = 'payments' AND window_id = 1",
            marks=pytest.mark.exhaustive,
        ),
    ],
    ids=["units-deleted", "units-truncated", "window-and-units-deleted"],
)
def test_ledger_rows_removed_under_a_live_follow_run_never_take_input_twice(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, removal: str
) -> None:
    source = tmp_path / "input"
    generate_payments(source, records=1200, files=5, duplicate_rate=0.0, invalid_rate=0.05)
    files = sorted((source / "payments").iterdir())
    (landing / "payments").mkdir(parents=True)

    def land(upto: int) -> None:
        for path in files[:upto]:
            target = landing / "payments" / path.name
            if not target.exists():
                shutil.copy2(path, target.with_suffix(".tmp"))
                target.with_suffix(".tmp").rename(target)

    env = cli_env(
        home=tmp_path / "home", dsn=pg_dsn, lake=lake, landing=landing,
        ONCEFLOW_JOBS="tests.support.payments_no_dedupe:JOB",
    )  # fmt: skip
    land(2)
    follow = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "run", "payments", "--follow",
         "--poll-interval", "0.3", "--max-files-per-window", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_completed(pg_dsn, 2, follow)
        # Removed while the run waits: windows 1 and 2's files are still in the landing
        # folder, so without their units they would look like new input at its next poll.
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(removal)
        time.sleep(2)  # several polls
        land(5)
        wait_completed(pg_dsn, 5, follow)
        time.sleep(2)  # more polls, with nothing new
        os.killpg(follow.pid, signal.SIGTERM)  # ends after its window
        _, err = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
    assert follow.returncode == 0, err[-3000:]
    # Five files, five windows: none planned twice, and every output exact (nothing doubled).
    assert windows(pg_dsn) == (5, 5)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    with psycopg.connect(pg_dsn) as conn:
        units = conn.execute(
            "SELECT count(*), count(DISTINCT window_id) FROM onceflow.source_units"
            " WHERE job = 'payments'"
        ).fetchone()
    assert units == (5, 5)  # the removed units are back, each with its window
    assert "rows of the ledger were removed while this run went on" in err, err[-3000:]
