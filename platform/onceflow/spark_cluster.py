"""A Spark standalone cluster from pyspark's own launcher classes (`onceflow spark-cluster`).

A master and workers are `org.apache.spark.deploy.master.Master` and
`org.apache.spark.deploy.worker.Worker`, run by the `spark-class` script inside the installed
`pyspark` package: nothing to download. Runs use the cluster with
`ONCEFLOW_SPARK_MASTER=spark://host:port`; their executors run on the workers, in Python workers
of the same interpreter as the driver, so start the workers in the jobs' environment (on another
machine: the same virtualenv path, with onceflow and the jobs' modules installed).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onceflow.errors import ConfigurationError
from onceflow.spark import quiet_java_options
from onceflow.spark_server import free_ports, spark_home, stop_group

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


@dataclass(frozen=True)
class ClusterConfig:
    """How to start the cluster.

    Attributes:
        host: Address the master and workers bind to.
        port: The master's port (`spark://host:port`).
        ui_port: The master's web UI port (its `/json/` page says which workers are alive).
        workers: How many workers.
        cores: Cores each worker offers.
        memory: Memory each worker offers (`1g`).
        work_dir: Where workers keep their executors' folders and logs.
    """

    work_dir: Path
    host: str = "127.0.0.1"
    port: int = 7077
    ui_port: int = 8080
    workers: int = 2
    cores: int = 1
    memory: str = "1g"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.cores < 1:
            raise ConfigurationError("a cluster needs at least one worker with one core.")

    @property
    def url(self) -> str:
        """The `spark://` URL runs set as `ONCEFLOW_SPARK_MASTER`."""
        return f"spark://{self.host}:{self.port}"

    def master_command(self) -> list[str]:
        return [_spark_class(), MASTER_CLASS, "--host", self.host, "--port", str(self.port),
                "--webui-port", str(self.ui_port)]  # fmt: skip

    def worker_command(self, index: int) -> list[str]:
        return [_spark_class(), WORKER_CLASS, self.url, "--host", self.host,
                "--cores", str(self.cores), "--memory", self.memory, "--webui-port", "0",
                "--work-dir", str(self.work_dir / f"worker-{index}")]  # fmt: skip

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.setdefault("SPARK_HOME", str(spark_home()))
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        java_options = " ".join(
            filter(None, [env.get("SPARK_DAEMON_JAVA_OPTS"), quiet_java_options()])
        )
        if java_options:
            env["SPARK_DAEMON_JAVA_OPTS"] = java_options
        return env


def master_state(host: str, ui_port: int) -> dict[str, Any]:
    """The master's `/json/` page (its workers and applications); empty while it is not up."""
    try:
        with urllib.request.urlopen(f"http://{host}:{ui_port}/json/", timeout=2) as answer:
            return dict(json.load(answer))
    except (OSError, ValueError, http.client.HTTPException):
        return {}  # not up yet, or another server on that port


def _spark_class() -> str:
    return str(spark_home() / "bin" / "spark-class")


class StandaloneCluster:
    """A master and its workers, each a process group of its own; a context manager."""

    def __init__(
        self, config: ClusterConfig, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self.env = config.environment(env)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return self.config.url

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                command,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def alive_workers(self) -> int:
        """Workers the master counts as alive (0 while the master is not up)."""
        state = master_state(self.config.host, self.config.ui_port)
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def start(self, timeout_s: float = 180.0) -> StandaloneCluster:
        """Start the master and the workers; return once every worker has registered."""
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        self._spawn("master", self.config.master_command())
        for i in range(self.config.workers):
            self._spawn(f"worker-{i}", self.config.worker_command(i))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    self.stop()
                    raise ConfigurationError(
                        f"a Spark cluster process exited with code {proc.returncode} while "
                        f"starting; see the logs in {self.log_dir}"
                    )
            if self.alive_workers() >= self.config.workers:
                return self
            time.sleep(0.5)
        self.stop()
        raise ConfigurationError(
            f"the Spark cluster at {self.url} did not have {self.config.workers} workers within "
            f"{timeout_s:.0f}s; see the logs in {self.log_dir}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the workers, then the master (each with its whole process group)."""
        for proc in reversed(self.procs):
            stop_group(proc, timeout_s)
        self.procs.clear()

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_cluster(
    work_dir: Path, workers: int = 2, cores: int = 1, memory: str = "1g"
) -> StandaloneCluster:
    """A cluster on free ports of this machine, its workers' folders and logs under `work_dir`."""
    port, ui_port = free_ports(2)
    config = ClusterConfig(
        work_dir=work_dir / "work",
        port=port,
        ui_port=ui_port,
        workers=workers,
        cores=cores,
        memory=memory,
    )
    return StandaloneCluster(config, work_dir / "logs")
