"""Jobs run exact through a real Spark Connect server (`onceflow spark-server`), crashes included.

The server is started the way a user starts it, as the `onceflow spark-server` command; each run
is a real `onceflow run` process attached with ONCEFLOW_SPARK_REMOTE and killed with SIGKILL at
its fault points. Killing a client leaves the server, and whatever it was doing for that client,
running: the replay must still be exact.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from onceflow.generate import generate_payments
from onceflow.spark import java_options
from onceflow.spark_server import SparkServerConfig, free_port
from tests.support.cli import ONCEFLOW, CliRun, Finished, cli_env
from tests.support.daily_totals_oracle import (
    assert_totals_exact,
    totals_from_delta,
    totals_from_landing,
)
from tests.support.matrix import points
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

ROOT = Path(__file__).resolve().parents[2]
SERVER_START_S = 180


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`onceflow spark-server` on a free port, in the repository (the jobs' code is importable)."""
    port = free_port()
    log = tmp_path_factory.mktemp("spark-server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [ONCEFLOW, "spark-server", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + SERVER_START_S
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
    yield Server(f"sc://127.0.0.1:{port}", proc, log)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Site:
    """One installation attached to the server: database, lake, landing folder and home."""

    server: Server
    dsn: str
    lake: Path
    landing: Path
    home: Path

    def env(self, fault: str | None = None, **extra: str) -> dict[str, str]:
        return cli_env(
            home=self.home,
            dsn=self.dsn,
            lake=self.lake,
            landing=self.landing,
            fault=fault,
            ONCEFLOW_SPARK_REMOTE=self.server.url,
            PYTHONPATH=str(ROOT),
            ONCEFLOW_DEBUG="1",  # a failure shows its whole traceback (the client has no JVM)
            **extra,
        )

    def run(self, *args: str, fault: str | None = None, **extra: str) -> Finished:
        return CliRun(list(args), self.env(fault, **extra), self.home / "logs").finish()

    def assert_payments_exact(self) -> None:
        assert_exact(expected_outputs(self.landing), actual_outputs(self.dsn, self.lake))


@pytest.fixture(scope="module")
def input_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("input")
    generate_payments(root, records=3000, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=7)
    return root / "payments"


@pytest.fixture()
def site(
    spark_server: Server, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, input_files: Path
) -> Site:
    shutil.copytree(input_files, landing / "payments")
    home = tmp_path / "home"
    home.mkdir()
    return Site(spark_server, pg_dsn, lake, landing, home)


def test_the_server_command_runs_pyspark_connect_server() -> None:
    command = SparkServerConfig(port=15123, master="local[2]").command()
    assert command[-1] == "spark-internal"
    assert "org.apache.spark.sql.connect.service.SparkConnectServer" in command
    assert "spark.connect.grpc.binding.port=15123" in command
    assert "spark.sql.session.timeZone=UTC" in command
    assert f"spark.driver.extraJavaOptions={java_options()}" in command


# A representative point through the server in CI (the local matrix, test_crash.py, has every
# point); the others run with `make test-all`.
@pytest.mark.parametrize(
    "point", points("before_sinks", "after_delta", "pg_commit_sent", in_ci=("pg_commit_sent",))
)
def test_payments_through_the_server_crash_then_rerun_is_exact(site: Site, point: str) -> None:
    crashed = site.run("run", "payments", "--max-files-per-window", "2", fault=f"{point}@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert f"fault injected at {point} (window 2)" in crashed.stderr

    rerun = site.run("run", "payments", "--max-files-per-window", "2")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "window 3" in rerun.stdout
    site.assert_payments_exact()
    # The server outlived the killed client and still serves.
    assert site.server.proc.poll() is None


def test_staged_job_through_the_server_crash_then_rerun_is_exact(site: Site) -> None:
    """A job whose outputs are staged (not declared deterministic) replays its stage."""
    jobs = {"ONCEFLOW_JOBS": "tests.support.staged_payments:STAGED_PAYMENTS"}
    crashed = site.run(
        "run", "payments", "--max-files-per-window", "2", fault="pg_commit_sent@2", **jobs
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    rerun = site.run("run", "payments", "--max-files-per-window", "2", **jobs)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    site.assert_payments_exact()


def test_daily_totals_through_the_server_crash_then_rerun_is_exact(site: Site) -> None:
    paid = site.run("run", "payments", "--max-files-per-window", "3")
    assert paid.returncode == 0, paid.stderr[-2000:]
    crashed = site.run(
        "run", "daily_totals", "--max-files-per-window", "1", fault="pg_commit_sent@2"
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = site.run("run", "daily_totals")
    assert recovered.returncode == 0, recovered.stderr[-2000:]

    truth = totals_from_landing(site.landing)
    assert totals_from_delta(site.lake) == truth
    diff = assert_totals_exact(truth, site.dsn, "daily_totals over Spark Connect")
    assert diff.lost == diff.doubled == 0
