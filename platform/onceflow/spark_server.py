"""A long-lived Spark Connect server for onceflow's runs (`onceflow spark-server`).

Every `onceflow run` and every Dagster run step otherwise starts its own Spark JVM, which costs
seconds to tens of seconds on a small machine. A Spark Connect server holds one JVM; runs attach
to it with `ONCEFLOW_SPARK_REMOTE=sc://host:port` and start in well under a second. The server
runs pyspark's own `SparkConnectServer` class through pyspark's `spark-submit`, so nothing beyond
the `pyspark` package is needed.

The server's Python workers import the jobs' code: start it in the same environment (virtualenv,
`PYTHONPATH`, working folder) as the runs that attach to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from onceflow.errors import ConfigurationError
from onceflow.spark import REQUIRED_CONF, defaults_for, java_options

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 15002
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def spark_home() -> Path:
    """The Spark distribution inside the installed `pyspark` package (or `SPARK_HOME`)."""
    given = os.environ.get("SPARK_HOME")
    if given:
        return Path(given)
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass(frozen=True)
class SparkServerConfig:
    """How to start the server.

    Attributes:
        host: Address the gRPC endpoint binds to.
        port: Its port.
        master: The server's `spark.master` (`local[2]`, `spark://…`).
        conf: Extra Spark settings, applied after onceflow's defaults.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    master: str = "local[2]"
    conf: Mapping[str, str] = field(default_factory=dict)

    @property
    def client_host(self) -> str:
        """The address a client on this machine reaches the server at."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    @property
    def url(self) -> str:
        """The `sc://` URL clients set as `ONCEFLOW_SPARK_REMOTE`."""
        return f"sc://{self.client_host}:{self.port}"

    def command(self) -> list[str]:
        """The `spark-submit` command line that runs the server in the foreground."""
        settings: dict[str, str] = {}
        if self.master.startswith("local"):
            settings.update(defaults_for(self.master))
        settings.update(REQUIRED_CONF)
        settings["spark.connect.grpc.binding.address"] = self.host
        settings["spark.connect.grpc.binding.port"] = str(self.port)
        settings["spark.driver.extraJavaOptions"] = java_options()
        settings["spark.executor.extraJavaOptions"] = java_options()
        settings.update(self.conf)
        submit = spark_home() / "bin" / "spark-submit"
        args = [str(submit), "--class", SERVER_CLASS, "--name", "onceflow-spark-server"]
        args += ["--master", self.master]
        for key, value in settings.items():
            args += ["--conf", f"{key}={value}"]
        return [*args, "spark-internal"]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: Python workers run this interpreter."""
        env = dict(os.environ if base is None else base)
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        env.setdefault("SPARK_HOME", str(spark_home()))
        return env


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise ConfigurationError(
                f"port {port} on {host} is taken (another Spark Connect server?); "
                "pick another with --port, or attach to that server with "
                f"ONCEFLOW_SPARK_REMOTE=sc://{host}:{port}"
            ) from None


def serve(config: SparkServerConfig) -> None:
    """Replace this process with the server (the CLI's foreground mode); never returns."""
    _check_port_free(config.host, config.port)
    command = config.command()
    print(
        f"onceflow spark-server: Spark Connect on {config.url} (master {config.master}); "
        f"runs attach with ONCEFLOW_SPARK_REMOTE={config.url}",
        file=sys.stderr,
        flush=True,
    )
    os.execve(command[0], command, config.environment())


class SparkServer:
    """A server started in the background, for `make dev`, tests and benchmarks.

    Use as a context manager, or call `start` and `stop`. Its output goes to `log`.
    """

    def __init__(
        self, config: SparkServerConfig, log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.config = config
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def start(self, timeout_s: float = 180.0) -> SparkServer:
        """Start the server and wait until its endpoint accepts connections."""
        _check_port_free(self.config.host, self.config.port)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.config.command(),
                env=self.config.environment(self.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        host = self.config.client_host
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigurationError(
                    f"the Spark Connect server exited with code {self.proc.returncode} while "
                    f"starting; see {self.log}"
                )
            try:
                with socket.create_connection((host, self.config.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise ConfigurationError(
            f"the Spark Connect server did not listen on {self.url} within {timeout_s:.0f}s; "
            f"see {self.log}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and its Python workers (its whole process group)."""
        if self.proc is not None:
            stop_group(self.proc, timeout_s)

    def __enter__(self) -> SparkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL it after `timeout_s`; wait for `proc`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port nothing listens on now (for tests and benchmarks that start their own server)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = DEFAULT_HOST) -> list[int]:
    """`count` distinct ports nothing listens on now (held open together while chosen)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def parse_conf(pairs: Sequence[str]) -> dict[str, str]:
    """`key=value` pairs from the command line."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"--conf expects key=value, got {pair!r}")
        conf[key.strip()] = value
    return conf
