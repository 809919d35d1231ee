"""Airflow on embedded defaults for the provider's tests: a SQLite metadata database in a
temporary AIRFLOW_HOME, migrated once per session, the project's DAG folder; each test gets
its own onceflow installation (ONCEFLOW_HOME with its embedded PostgreSQL, lake, landing).

Runs in `.venv-airflow`; the `onceflow` command and the oracle run in the project's `.venv`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROJECT_BIN = REPO / ".venv" / "bin"
AIRFLOW_BIN = Path(sys.executable).parent

# Before Airflow is imported: its configuration is read once, at import.
_home = Path(tempfile.mkdtemp(prefix="airflow-home-"))
os.environ.update(
    AIRFLOW_HOME=str(_home),
    AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "integrations" / "airflow" / "dags"),
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__PARALLELISM="2",
    # Asset events queue runs of unpaused DAGs only (daily_totals after payments).
    AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
    GX_ANALYTICS_ENABLED="false",
)
# The project's code first, as `make` and the main suite run it (the venv is an editable
# install that may point at another checkout).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO / "platform"), os.environ.get("PYTHONPATH", "")) if p
)


def airflow_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(AIRFLOW_BIN / "airflow"), *args], capture_output=True, text=True, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"airflow {' '.join(args)}: {proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def airflow_db() -> Path:
    airflow_cli("db", "migrate")
    return _home


@pytest.fixture()
def onceflow_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A fresh onceflow installation on embedded defaults, in this process's environment (the
    DAG factory and the commands read it)."""
    # Short: the embedded PostgreSQL's Unix socket lives under it (at most 107 characters).
    home = Path(tempfile.mkdtemp(prefix="of-"))
    env = {
        "ONCEFLOW_HOME": str(home),
        "ONCEFLOW_LAKE": str(home / "lake"),
        "ONCEFLOW_LANDING": str(home / "landing"),
    }
    (home / "landing" / "payments").mkdir(parents=True)
    for key in [k for k in os.environ if k.startswith("ONCEFLOW_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    shutil.rmtree(home, ignore_errors=True)


def project(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The project's Python with `args`, the repository on its path (for tests.support)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join((str(REPO), env["PYTHONPATH"]))
    proc = subprocess.run(
        [str(PROJECT_BIN / "python"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def onceflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PROJECT_BIN / "onceflow"), *args], capture_output=True, text=True, cwd=REPO
    )


def generate(records: int = 1200, files: int = 6) -> None:
    done = onceflow(
        "generate",
        "payments",
        "--records",
        str(records),
        "--files",
        str(files),
        "--duplicate-rate",
        "0.1",
        "--invalid-rate",
        "0.05",
    )
    assert done.returncode == 0, done.stderr[-2000:]


def distance(job: str) -> dict[str, dict[str, int]]:
    """How far `job`'s sinks are from the oracle: per output, lost, doubled, other."""
    out = project(str(HERE / "exact.py"), job).stdout
    return json.loads(out.strip().splitlines()[-1])


def assert_exact(job: str) -> dict[str, Any]:
    diffs = distance(job)
    print(f"{job} against the oracle: {diffs}")
    assert all(d == {"lost": 0, "doubled": 0, "other": 0} for d in diffs.values()), diffs
    return diffs
