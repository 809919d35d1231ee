"""`onceflow demo`: generate input, crash a run mid-commit, recover, validate, report."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from onceflow.generate import generate_payments_into
from onceflow.ledger import Ledger
from onceflow.postgres import resolve_dsn, stop_embedded
from onceflow.settings import Settings


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(records: int = 20000, files: int = 8) -> int:
    """Run the demo on the settings from the environment; return the exit code."""
    settings = Settings.from_env()
    settings.check_folders()
    _say(f"state under {settings.home}")
    generated = generate_payments_into(
        settings.landing,
        records=records,
        files=files,
        duplicate_rate=0.05,
        invalid_rate=0.02,
        seed=int(time.time()),
    )
    print(
        f"generated {len(generated.files)} files: {len(generated.payments)} payments, "
        f"{generated.duplicates} duplicates, {len(generated.invalid)} invalid lines"
    )
    dsn = resolve_dsn(settings.postgres_dsn, settings.home)
    ledger = Ledger(dsn, "payments")
    ledger.ensure_schema()
    crash_window = ledger.last_window_id() + 2
    env = {**os.environ, "ONCEFLOW_FAULT": f"pg_commit_sent@{crash_window}"}
    if settings.postgres_dsn is None:
        env["ONCEFLOW_POSTGRES_DSN"] = dsn
    cmd = [sys.executable, "-m", "onceflow.cli", "run", "payments", "--max-files-per-window", "2"]
    _say(f"run 1: killed with SIGKILL right after sending COMMIT for window {crash_window}")
    first = subprocess.run(cmd, env=env, check=False)
    print(f"run 1 ended with {'SIGKILL' if first.returncode == -9 else first.returncode}")
    _say("run 2: the same command; it replays the planned window and decides by the markers")
    env.pop("ONCEFLOW_FAULT")
    second = subprocess.run(cmd, env=env, check=False)
    if second.returncode != 0:
        print("run 2 failed; see the message above")
        return second.returncode
    _say("run 3: no new input, so nothing changes")
    third = subprocess.run(cmd, env=env, check=False)
    _say("validation (Great Expectations suites) and status")
    checks = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "validate", "payments"], env=env, check=False
    )
    subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "status", "payments"], env=env, check=False
    )
    ok = third.returncode == 0 and checks.returncode == 0
    _say("exactly once: every check passed" if ok else "a check failed: see above")
    if settings.postgres_dsn is None:
        stopped = stop_embedded(settings.home)
        print(
            "embedded PostgreSQL stopped"
            if stopped
            else "embedded PostgreSQL left running: another process still uses it"
        )
    return 0 if ok else 1
