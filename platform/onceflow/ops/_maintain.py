"""Maintenance of a job's Delta sinks (`onceflow maintain JOB`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from onceflow.maintain import ORPHAN_AGE, MaintainResult, Options, maintain_job
from onceflow.ops._engine import JobRef, open_engine

if TYPE_CHECKING:
    from onceflow.job import Job
    from onceflow.settings import Settings


def maintain(
    job: JobRef,
    settings: Settings | None = None,
    *,
    dsn: str | None = None,
    dry_run: bool = False,
    jobs: Sequence[Job] | None = None,
    orphan_age_s: float | None = None,
    run_id: str | None = None,
) -> MaintainResult:
    """Compact, checkpoint, vacuum and clean the log of every Delta sink of `job`, keeping
    every file a downstream job, a replay or an unfinished restatement still needs, and the
    tables' own retention (`delta.deletedFileRetentionDuration`, `delta.logRetentionDuration`).

    Args:
        job: The job (a name, a Job or an open engine).
        dry_run: Report what would be done; change nothing, take no fence.
        jobs: The jobs that may read its tables (default: every job the registry finds).
        orphan_age_s: Files no log entry names are removed once older than this (default
            one hour), under the job's fence.
        run_id: Names the fence when orphans are removed.
    """
    engine = open_engine(job, settings, dsn=dsn)
    if jobs is None:
        from onceflow.registry import load_jobs

        jobs = list(load_jobs().jobs.values())
    if engine.job.name not in {j.name for j in jobs}:
        jobs = [*jobs, engine.job]
    age = ORPHAN_AGE if orphan_age_s is None else timedelta(seconds=orphan_age_s)
    options = Options(dry_run=dry_run, orphan_age=age)
    return maintain_job(engine, jobs, options, run_id)


__all__ = ["MaintainResult", "maintain"]
