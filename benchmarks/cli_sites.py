"""The real `onceflow` CLI for benchmarks: one installation per mode, each run timed to exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from peer_pipeline import fresh_database

ONCEFLOW = str(Path(sys.executable).with_name("onceflow"))


def site_env(
    work: Path, server_dsn: str, name: str, records: Path | None, **extra: str
) -> dict[str, str]:
    """The environment of one installation under `work/name`: its home, lake and landing
    folder (holding a copy of `records`, the payments files, if given) and a fresh database;
    this process's environment without its ONCEFLOW_* settings, then `extra`."""
    home = work / name
    landing = home / "landing"
    landing.mkdir(parents=True)
    if records is not None:
        shutil.copytree(records, landing / "payments")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env.update(
        PYSPARK_PYTHON=sys.executable,
        GX_ANALYTICS_ENABLED="false",
        ONCEFLOW_HOME=str(home),
        ONCEFLOW_LAKE=str(home / "lake"),
        ONCEFLOW_LANDING=str(landing),
        ONCEFLOW_POSTGRES_DSN=fresh_database(server_dsn, f"bench_{name}"),
    )
    env.update(extra)
    return env


def run_cli(env: dict[str, str], *args: str) -> float:
    """Run `onceflow *args`; its wall time from start to exit (a failure ends the benchmark)."""
    started = time.perf_counter()
    done = subprocess.run([ONCEFLOW, *args], env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"onceflow {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return elapsed
