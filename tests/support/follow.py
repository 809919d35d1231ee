"""Watching a `run --follow` process from a test: the windows its ledger has completed."""

from __future__ import annotations

import subprocess
import time

import psycopg


def windows(dsn: str, job: str = "payments") -> tuple[int, int]:
    """(windows planned, windows completed) of `job`; (0, 0) before the run made its ledger."""
    with psycopg.connect(dsn) as conn:
        if conn.execute("SELECT to_regclass('onceflow.windows')").fetchone() == (None,):
            return 0, 0
        row = conn.execute(
            "SELECT count(*), count(completed_at) FROM onceflow.windows WHERE job = %s", (job,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_completed(
    dsn: str, count: int, proc: subprocess.Popen, timeout: float = 240, job: str = "payments"
) -> None:
    """Wait until `job` has `count` completed windows; fail if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read()[-3000:] if proc.stderr else ""
            raise AssertionError(f"the follow run exited early ({proc.returncode}): {err}")
        if windows(dsn, job)[1] >= count:
            return
        time.sleep(0.3)
    raise AssertionError(f"windows completed never reached {count}; have {windows(dsn, job)}")
