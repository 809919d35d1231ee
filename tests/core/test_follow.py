"""`onceflow run payments --follow`: commits files as they land, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from onceflow.generate import generate_payments
from tests.support.oracle import expected_outputs

pytestmark = pytest.mark.slow


def _count(dsn: str) -> int:
    try:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT count(*) FROM public.payments").fetchone()
            return int(row[0]) if row else 0
    except psycopg.errors.UndefinedTable:
        return 0


def _wait_for(dsn: str, rows: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the follow run exited early"
        if _count(dsn) >= rows:
            return
        time.sleep(0.5)
    raise AssertionError(f"rows never reached {rows}; have {_count(dsn)}")


def test_follow_commits_new_files_and_stops_on_sigterm(
    pg_dsn: str, tmp_path: Path, landing: Path, lake: Path
) -> None:
    env = {
        **os.environ,
        "ONCEFLOW_HOME": str(tmp_path / "home"),
        "ONCEFLOW_POSTGRES_DSN": pg_dsn,
        "ONCEFLOW_LAKE": str(lake),
        "ONCEFLOW_LANDING": str(landing),
    }
    first = generate_payments(landing, records=300, files=2, duplicate_rate=0.1, seed=11)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "run", "payments", "--follow", "--poll-interval",
         "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(pg_dsn, len(first.payments), proc)
        second = generate_payments(landing, records=200, files=2, invalid_rate=0.1, seed=12)
        _wait_for(pg_dsn, len(first.payments) + len(second.payments), proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "window" in out
    expected = expected_outputs(landing)
    with psycopg.connect(pg_dsn) as conn:
        ids = {r[0] for r in conn.execute("SELECT payment_id FROM public.payments")}
        quarantined = conn.execute("SELECT count(*) FROM onceflow.quarantine").fetchone()
    assert ids == set(expected.payments)
    assert quarantined is not None and quarantined[0] == len(expected.quarantine)
