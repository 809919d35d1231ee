"""The payments job on a two-worker Spark standalone cluster, through a crash and a replay."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceflow.generate import generate_payments
from onceflow.spark_cluster import StandaloneCluster, local_cluster, master_state
from onceflow.spark_server import free_ports
from tests.support.cli import CliRun, cli_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with local_cluster(tmp_path_factory.mktemp("cluster"), workers=2, cores=1) as started:
        yield started


def _apps(cluster: StandaloneCluster) -> list[dict]:
    state = master_state(cluster.config.host, cluster.config.ui_port)
    return [*state.get("activeapps", []), *state.get("completedapps", [])]


def test_spark_cluster_command_serves_until_sigterm(tmp_path: Path) -> None:
    port, ui_port = free_ports(2)
    args = ["spark-cluster", "--workers", "1", "--port", str(port), "--ui-port", str(ui_port),
            "--work-dir", str(tmp_path / "cluster")]  # fmt: skip
    run = CliRun(args, dict(os.environ), tmp_path / "logs")
    try:
        deadline = time.monotonic() + 180
        alive: list[dict] = []
        while not alive and time.monotonic() < deadline:
            assert run.proc.poll() is None, "onceflow spark-cluster exited while starting"
            workers = master_state("127.0.0.1", ui_port).get("workers", [])
            alive = [w for w in workers if w["state"] == "ALIVE"]
            time.sleep(0.5)
        assert len(alive) == 1
        os.kill(run.pid, signal.SIGTERM)
        done = run.finish(timeout=120)
    finally:
        run.kill_group()
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ONCEFLOW_SPARK_MASTER=spark://127.0.0.1:{port}" in done.stderr
    with pytest.raises(OSError):  # the master is gone with the command
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# The store variant below (CI's) asserts the same of a cluster with nothing shared but the store.
@pytest.mark.exhaustive
def test_payments_exact_on_a_two_worker_cluster_through_a_crash(
    cluster: StandaloneCluster, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=3000, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    env["ONCEFLOW_SPARK_MASTER"] = cluster.url
    args = ["run", "payments", "--max-files-per-window", "2"]

    crashed = CliRun(args, {**env, "ONCEFLOW_FAULT": "after_delta@2"}, home / "logs").finish()
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "fault injected at after_delta (window 2)" in crashed.stderr

    rerun = CliRun(args, env, home / "logs").finish()
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

    # Both runs were applications of the cluster, and its two workers ran their executors.
    assert len(_apps(cluster)) >= 2
    work = cluster.config.work_dir
    for worker in ("worker-0", "worker-1"):
        assert list((work / worker).glob("app-*")), f"no executor ran on {worker}"


def test_payments_exact_on_the_cluster_with_lake_and_landing_on_a_store(
    cluster: StandaloneCluster, pg_dsn: str, landing: Path, tmp_path: Path
) -> None:
    """Nothing shared between the machines but the store and PostgreSQL: the lake and the
    landing files on the local S3 server, the job on the two workers, killed and run again."""
    from onceflow.s3_server import LocalS3
    from onceflow.storage import Location

    generate_payments(landing, records=3000, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    with LocalS3(log=tmp_path / "s3.log") as s3:
        s3.create_bucket("shared")
        store_landing = Location.parse("s3://shared/landing", s3.env())
        for path in sorted((landing / "payments").iterdir()):
            (store_landing / "payments" / path.name).write_bytes(path.read_bytes())
        lake = Location.parse("s3://shared/lake", s3.env())
        home = tmp_path / "home"
        env = cli_env(home=home, dsn=pg_dsn, lake=lake.uri, landing=store_landing.uri)  # type: ignore[arg-type]
        env.update(s3.env(), ONCEFLOW_SPARK_MASTER=cluster.url)
        args = ["run", "payments", "--max-files-per-window", "2"]
        crashed = CliRun(args, {**env, "ONCEFLOW_FAULT": "after_delta@2"}, home / "logs").finish()
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
        assert "fault injected at after_delta (window 2)" in crashed.stderr
        rerun = CliRun(args, env, home / "logs").finish()
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
        assert not (home / "lake").exists() and not (home / "landing").exists()
    # Both runs were applications of the cluster, and its two workers ran their executors.
    assert len(_apps(cluster)) >= 2
    work = cluster.config.work_dir
    for worker in ("worker-0", "worker-1"):
        assert list((work / worker).glob("app-*")), f"no executor ran on {worker}"
