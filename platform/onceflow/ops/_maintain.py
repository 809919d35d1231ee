"""Maintenance of a job's Delta sinks (`onceflow maintain JOB`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError
from onceflow.maintain import KEEP_DETAIL, ORPHAN_AGE, MaintainResult, Options, maintain_job
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
    keep_detail_days: float | None = None,
    run_id: str | None = None,
) -> MaintainResult:
    """Compact, checkpoint, vacuum and clean the log of every Delta sink of `job`, keeping
    every file a downstream job, a replay or an unfinished restatement still needs, and the
    tables' own retention (`delta.deletedFileRetentionDuration`, `delta.logRetentionDuration`);
    then drop the ledger's per-window detail that only a look back reads (lineage rows,
    accumulating sinks' contributions) for the windows past the job's detail horizon.

    Args:
        job: The job (a name, a Job or an open engine).
        dry_run: Report what would be done; change nothing, take no fence.
        jobs: The jobs that may read its tables (default: every job the registry finds).
        orphan_age_s: Files no log entry names are removed once older than this (default
            one hour), under the job's fence.
        keep_detail_days: Windows planned within this keep their detail (default 30): they
            can be restated; older ones cannot where restating reads what was dropped.
        run_id: Names the fence when orphans are removed.
    """
    engine = open_engine(job, settings, dsn=dsn)
    if jobs is None:
        from onceflow.registry import load_jobs

        jobs = list(load_jobs().jobs.values())
    if engine.job.name not in {j.name for j in jobs}:
        jobs = [*jobs, engine.job]
    age = ORPHAN_AGE if orphan_age_s is None else timedelta(seconds=orphan_age_s)
    keep = KEEP_DETAIL if keep_detail_days is None else timedelta(days=keep_detail_days)
    if keep < timedelta(0):
        raise ConfigurationError(f"keep_detail_days must not be negative (got {keep_detail_days})")
    options = Options(dry_run=dry_run, orphan_age=age, keep_detail=keep)
    return maintain_job(engine, jobs, options, run_id)


__all__ = ["MaintainResult", "maintain"]
