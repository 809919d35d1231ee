"""Operations that look at a job's sinks: validate, status, reconcile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._results import StatusResult, ValidateResult

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.reconcile import ReconcileReport
    from onceflow.settings import Settings


def validate(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    data_docs_dir: Path | None = None,
) -> ValidateResult:
    """Run the job's quality suites against its sinks (`passed` says whether all held)."""
    from onceflow.validation import validate_job

    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    return ValidateResult(validate_job(engine, data_docs_dir))


def status(
    job: JobRef, settings: Settings | None = None, *, dsn: str | None = None
) -> StatusResult:
    """The job's windows, sinks' commit state, lag and open items (no Spark)."""
    from onceflow.status import job_status

    engine = open_engine(job, settings, dsn=dsn)
    return StatusResult(engine.job.name, job_status(engine))


def reconcile(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    mode: Literal["full", "incremental"] = "full",
    dry_run: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> ReconcileReport:
    """Diff every sink with what it should hold and repair the difference (unless `dry_run`)."""
    from onceflow.reconcile import reconcile as reconcile_job

    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    return reconcile_job(engine, dry_run=dry_run, mode=mode, on_step=on_step)
