"""Running the project's `onceflow` command from Airflow's environment: where it is, the
environment it needs, and its one JSON object on stdout.

The command's path: env `ONCEFLOW_COMMAND`, else Airflow's `[onceflow] command` setting
(`AIRFLOW__ONCEFLOW__COMMAND`), else the project's `.venv/bin/onceflow` beside this provider.
It runs in env `ONCEFLOW_PROJECT_DIR`, `[onceflow] project_dir`, or the project's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# integrations/airflow/onceflow_airflow/command.py → the repository's root.
PROJECT_ROOT = Path(__file__).resolve().parents[3]
COMMAND_ENV = "ONCEFLOW_COMMAND"
PROJECT_DIR_ENV = "ONCEFLOW_PROJECT_DIR"
# sysexits.h EX_TEMPFAIL, `onceflow.ops.EXIT_RETRYABLE`: the same command may succeed later.
EXIT_RETRYABLE = 75
# Airflow's own variables, which mean nothing to onceflow's venv.
_DROPPED = ("PYTHONHOME", "VIRTUAL_ENV")


def _setting(env_name: str, key: str) -> str | None:
    value = os.environ.get(env_name, "").strip()
    if value:
        return value
    try:
        from airflow.configuration import conf

        value = (conf.get("onceflow", key, fallback="") or "").strip()
    except Exception:  # no Airflow configuration (a plain import): the default applies
        value = ""
    return value or None


def onceflow_command() -> Path:
    """The `onceflow` command's path (see the module's text)."""
    given = _setting(COMMAND_ENV, "command")
    return Path(given) if given else PROJECT_ROOT / ".venv" / "bin" / "onceflow"


def project_dir() -> Path:
    given = _setting(PROJECT_DIR_ENV, "project_dir")
    return Path(given) if given else PROJECT_ROOT


def command_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Airflow's environment for the command, less Airflow's venv, with Spark's workers on the
    command's own Python (PYSPARK_PYTHON) unless set."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    python = onceflow_command().parent / "python"
    env.setdefault("PYSPARK_PYTHON", str(python))
    env.setdefault("GX_ANALYTICS_ENABLED", "false")
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Outcome:
    """A finished command: its exit code, its JSON result (None when it printed none) and the
    tail of its stderr."""

    argv: tuple[str, ...]
    returncode: int
    result: dict[str, Any] | None
    stderr: str

    @property
    def message(self) -> str:
        if self.result and self.result.get("message"):
            return str(self.result["message"])
        tail = self.stderr.strip().splitlines()[-5:]
        return "\n".join(tail) or f"exit code {self.returncode}"


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The command's JSON object: stdout is that object (indented over lines, or on one)."""
    lines = stdout.strip().splitlines()
    # From the last line that opens an object at its start, so stray lines before it pass.
    for start in reversed([i for i, line in enumerate(lines) if line.startswith("{")]):
        try:
            value = json.loads("\n".join(lines[start:]))
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def run_command(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    python_module: str | None = None,
    timeout: float | None = None,
) -> Outcome:
    """Run `onceflow ARGS` (or, with `python_module`, the command's Python `-m MODULE ARGS`)
    in the project folder and collect its outcome."""
    command = onceflow_command()
    if python_module:
        argv = [str(command.parent / "python"), "-m", python_module, *args]
    else:
        argv = [str(command), *args]
    if not Path(argv[0]).exists():
        raise FileNotFoundError(
            f"{argv[0]} does not exist: run `make setup` in the onceflow project, or point "
            f"{COMMAND_ENV} (or [onceflow] command) at its `onceflow` command"
        )
    proc = subprocess.run(
        argv,
        cwd=project_dir(),
        env=command_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Outcome(tuple(argv), proc.returncode, parse_result(proc.stdout), proc.stderr)


def catalog(jobs: Sequence[str] = (), *, pending: bool = False) -> dict[str, Any]:
    """`python -m onceflow.ops.catalog`: each job's sink addresses and inputs (no Spark)."""
    outcome = run_command(
        [*jobs, *(["--pending"] if pending else [])], python_module="onceflow.ops.catalog"
    )
    if outcome.returncode != 0 or outcome.result is None:
        raise RuntimeError(f"onceflow's catalog failed: {outcome.message}")
    return outcome.result["jobs"]
