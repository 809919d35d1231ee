"""The `onceflow` command line as a real process in its own session, killable with its JVM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ONCEFLOW = str(Path(sys.executable).with_name("onceflow"))
RUN_TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]

# The JVMs of a CLI process under test live for seconds over a few thousand rows: compiling
# only with C1 (no C2) cut a 3-window, 3,000-row `run`'s JVM CPU from 33 to 24 s (2 cores,
# loaded, measured). Not what ships: a long run's hot loops want C2. `JDK_JAVA_OPTIONS`
# already set (by whoever runs the tests) is kept.
TEST_JVM_ENV = {"JDK_JAVA_OPTIONS": os.environ.get("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1")}


def cli_env(
    *, home: Path, dsn: str, lake: Path, landing: Path, fault: str | None = None, **extra: str
) -> dict[str, str]:
    """The environment of an `onceflow` process for one installation: this process's, without
    its own ONCEFLOW_* settings, then these (`fault`: ONCEFLOW_FAULT; `extra`: anything else)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env.update(
        ONCEFLOW_HOME=str(home),
        ONCEFLOW_POSTGRES_DSN=dsn,
        ONCEFLOW_LAKE=str(lake),
        ONCEFLOW_LANDING=str(landing),
        GX_ANALYTICS_ENABLED="false",
        **TEST_JVM_ENV,
    )
    if fault:
        env["ONCEFLOW_FAULT"] = fault
    env.update(extra)
    return env


def jobs_env(entry: str) -> dict[str, str]:
    """The environment that has an `onceflow` process load its jobs from `entry` (an import
    path under `tests.support`, as in ONCEFLOW_JOBS), the repository on its path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"ONCEFLOW_JOBS": entry, "PYTHONPATH": path}


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class CliRun:
    """One `onceflow` process in its own session, so its Spark JVM can be killed with it."""

    def __init__(
        self, args: list[str], env: dict[str, str], logs: Path, cwd: Path | None = None
    ) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.monotonic_ns()}"
        self._out_path = logs / f"{stamp}.out"
        self._err_path = logs / f"{stamp}.err"
        self._out = open(self._out_path, "wb")
        self._err = open(self._err_path, "wb")
        self.proc = subprocess.Popen(
            [ONCEFLOW, *args],
            env=env,
            cwd=cwd or logs,
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> Finished:
        """Wait for the process, then kill whatever is left of its group (the JVM)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.proc.wait()
            pytest.fail(f"onceflow did not finish within {timeout}s: {self.stderr()[-2000:]}")
        finally:
            self.kill_group()
            self._out.close()
            self._err.close()
        return Finished(rc, self._out_path.read_text(errors="replace"), self.stderr())

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self._err_path.read_text(errors="replace")
