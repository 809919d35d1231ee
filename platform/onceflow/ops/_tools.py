"""What is not an operation on a job's windows: the jobs onceflow finds, synthetic input, the
demo, opening a job's engine from the environment the way a command line does, and the local
servers (Spark Connect, a Spark standalone cluster, an S3-compatible store)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from onceflow.ops._results import GenerateResult, JobInfo, JobsResult

if TYPE_CHECKING:
    from onceflow.engine import Engine
    from onceflow.s3_server import LocalS3
    from onceflow.settings import Settings
    from onceflow.spark_cluster import StandaloneCluster


def jobs() -> JobsResult:
    """The jobs onceflow finds (`onceflow.registry`), described.

    Raises:
        ConfigurationError: The job modules cannot be loaded.
    """
    from onceflow.registry import load_jobs

    found = load_jobs()
    return JobsResult(
        str(found.origin),
        tuple(
            JobInfo(
                job.name,
                job.source.describe(),
                tuple((s.name, s.describe()) for s in job.sinks),
                job.guarantee.value,
            )
            for job in found.jobs.values()
        ),
    )


def generate(
    job: str,
    *,
    records: int,
    files: int,
    duplicate_rate: float = 0.0,
    invalid_rate: float = 0.0,
    seed: int = 0,
    settings: Settings | None = None,
) -> GenerateResult:
    """Write synthetic `payments` input into the landing folder of `settings` (default: the
    environment's).

    Raises:
        ConfigurationError: There is no generator for `job`.
    """
    from onceflow.errors import ConfigurationError
    from onceflow.generate import generate_payments_into
    from onceflow.settings import Settings

    if job != "payments":
        raise ConfigurationError(
            f"there is no generator for {job!r}; `generate` writes `payments` input."
        )
    settings = settings or Settings.from_env()
    settings.landing.mkdir()
    out = generate_payments_into(
        settings.landing,
        records=records,
        files=files,
        duplicate_rate=duplicate_rate,
        invalid_rate=invalid_rate,
        seed=seed,
        job=job,
    )
    return GenerateResult(
        job,
        str(settings.landing / job),
        len(out.files),
        len(out.payments),
        out.duplicates,
        len(out.invalid),
    )


def demo(records: int = 20000, files: int = 8) -> int:
    """Generate input, crash a run mid-commit, recover, validate; its exit code."""
    from onceflow.demo import run_demo

    return run_demo(records=records, files=files)


def spark_log(settings: Settings) -> Path | None:
    """Where a session started by `open_from_env` logs (None: the console, ONCEFLOW_DEBUG)."""
    from onceflow.spark import debug_enabled

    return None if debug_enabled() else settings.home / "logs" / "spark.log"


def open_from_env(
    job: str, *, spark: bool = True, check_input: bool = False, guarantee: str | None = None
) -> Engine:
    """The engine of the registered job `job` on the environment's settings, checked before
    anything slow starts: the folders, the input (with `check_input`), PostgreSQL reachable;
    then a Spark session (unless `spark` is False) per ONCEFLOW_SPARK_MASTER/_REMOTE.

    Raises:
        ConfigurationError: No such job, or wrong folders or input.
        PostgresUnavailableError: PostgreSQL cannot be reached.
    """
    from onceflow.engine import build_engine
    from onceflow.postgres import check_reachable, resolve_dsn
    from onceflow.registry import get_job
    from onceflow.settings import Settings
    from onceflow.spark import build_spark_session

    settings = Settings.from_env()
    found = get_job(job)
    settings.check_folders()
    if check_input:
        found.source.check_input(settings)  # a missing folder fails before anything starts
    dsn = resolve_dsn(settings.postgres_dsn, settings.home)
    check_reachable(dsn)  # before Spark starts: a wrong DSN fails at once, a down server soon
    session = None
    if spark:
        session = build_spark_session(
            master=os.environ.get("ONCEFLOW_SPARK_MASTER"),
            remote=os.environ.get("ONCEFLOW_SPARK_REMOTE"),
            log_file=spark_log(settings),
        )
    return build_engine(found, settings, session, dsn, guarantee=guarantee)


def serve_spark_connect(host: str, port: int, master: str, conf: Sequence[str] = ()) -> None:
    """Replace this process with a long-lived Spark Connect server (`KEY=VALUE` settings)."""
    from onceflow.spark_server import SparkServerConfig, parse_conf, serve

    serve(SparkServerConfig(host, port, master, parse_conf(list(conf))))


def spark_cluster(
    work_dir: Path,
    *,
    host: str,
    port: int,
    ui_port: int,
    workers: int,
    cores: int,
    memory: str,
) -> StandaloneCluster:
    """A Spark standalone master and workers, started when entered, stopped when left."""
    from onceflow.spark_cluster import ClusterConfig, StandaloneCluster

    config = ClusterConfig(
        work_dir=work_dir,
        host=host,
        port=port,
        ui_port=ui_port,
        workers=workers,
        cores=cores,
        memory=memory,
    )
    return StandaloneCluster(config, config.work_dir / "logs")


def s3_server(host: str, port: int) -> LocalS3:
    """A local, in-memory S3-compatible store, started when entered, stopped when left."""
    from onceflow.s3_server import LocalS3

    return LocalS3(host=host, port=port)
