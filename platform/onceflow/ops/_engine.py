"""The engine an operation works with, from a job, a job's name, or an engine already open."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.engine import Engine, build_engine
from onceflow.job import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.settings import Settings

# What an operation accepts as its job: a registered job's name, a Job, or an engine already
# open on it (an orchestrator that reads the engine's sinks after the operation passes one).
JobRef = str | Job | Engine


def open_engine(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    guarantee: str | None = None,
) -> Engine:
    """The engine for `job`: `settings` default to the environment's (`Settings.from_env`),
    `dsn` to the settings' PostgreSQL (or the embedded server's). An engine is returned as is.

    Raises:
        ConfigurationError: No job of that name, or the settings' folders are wrong.
    """
    if isinstance(job, Engine):
        return job
    from onceflow.postgres import resolve_dsn
    from onceflow.registry import get_job
    from onceflow.settings import Settings

    settings = settings or Settings.from_env()
    if isinstance(job, str):
        job = get_job(job)
    dsn = dsn or resolve_dsn(settings.postgres_dsn, settings.home)
    return build_engine(job, settings, spark, dsn, guarantee=guarantee)
