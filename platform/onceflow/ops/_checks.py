"""Operations that look at a job's sinks and ledger: validate, status, reconcile, and what an
orchestrator's sensors and checks read (pending work, freshness, open items, lineage)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from onceflow.ops._engine import JobRef, open_engine
from onceflow.ops._results import StatusResult, ValidateResult

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.lineage import LineageRow
    from onceflow.reconcile import ReconcileReport
    from onceflow.settings import Settings
    from onceflow.status import Freshness, OpenItems, PendingWork


def validate(
    job: JobRef,
    settings: Settings | None = None,
    *,
    spark: SparkSession | None = None,
    dsn: str | None = None,
    data_docs_dir: Path | None = None,
    sinks: Iterable[str] | None = None,
) -> ValidateResult:
    """Run the job's quality suites against its sinks, those named in `sinks` (default all);
    `passed` says whether all held."""
    from onceflow.validation import validate_job

    engine = open_engine(job, settings, spark=spark, dsn=dsn)
    if sinks is None:
        return ValidateResult(validate_job(engine, data_docs_dir))
    from onceflow.quality import validate as run_suites
    from onceflow.validation import quality_targets

    wanted = set(sinks)
    engine.prepare()
    docs = data_docs_dir or engine.settings.home / "data_docs" / engine.job.name
    targets = [t for t in quality_targets(engine) if t.sink in wanted]
    return ValidateResult(
        run_suites(engine.job.name, targets, dsn=engine.dsn, spark=engine.spark, data_docs_dir=docs)
    )


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


def pending_work(
    job: JobRef, settings: Settings | None = None, *, dsn: str | None = None
) -> PendingWork:
    """What the job has not yet planned or committed, from the ledger and the source (no
    Spark): the trigger for its next run."""
    from onceflow.status import pending_work as job_pending_work

    return job_pending_work(open_engine(job, settings, dsn=dsn))


def freshness(
    job: JobRef, settings: Settings | None = None, *, dsn: str | None = None
) -> Freshness:
    """Whether the job's input is planned within its `freshness_s`, and committed input that
    changed since (no Spark)."""
    from onceflow.status import freshness as job_freshness

    return job_freshness(open_engine(job, settings, dsn=dsn))


def open_items(
    job: JobRef, settings: Settings | None = None, *, dsn: str | None = None
) -> OpenItems:
    """Unfinished restatements, skipped and abandoned windows, cancelled restatements."""
    from onceflow.status import open_items as job_open_items

    return job_open_items(open_engine(job, settings, dsn=dsn))


def lineage(
    job: JobRef, settings: Settings | None = None, *, dsn: str | None = None, limit: int = 20
) -> list[LineageRow]:
    """The newest `limit` windows of the job's lineage (`onceflow.lineage`), newest first."""
    from onceflow.lineage import lineage as read_lineage

    engine = open_engine(job, settings, dsn=dsn)
    return read_lineage(engine.dsn, engine.job.name, limit=limit)
