"""A job's maintenance: each Delta sink's table, past the horizon its readers set."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from onceflow.job import Job
from onceflow.maintain._detail import prune_detail
from onceflow.maintain._horizon import downstream_holds
from onceflow.maintain._options import Options
from onceflow.maintain._report import MaintainResult
from onceflow.window.context import JobContext


def maintain_job(
    ctx: JobContext,
    jobs: Sequence[Job],
    options: Options | None = None,
    run_id: str | None = None,
) -> MaintainResult:
    """Compact, checkpoint, vacuum and clean the log of every Delta sink of `ctx.job`, then
    drop the ledger's per-window detail past the job's detail horizon (`_detail`).

    Args:
        ctx: The job (its settings, ledger and sink groups); no Spark session is needed.
        jobs: The jobs that may read its tables (a downstream job's ledger sets the horizon).
        options: Dry run, orphan age, compaction target, how long detail is kept.
        run_id: Names the fence, when one is taken (orphans to remove).

    Raises:
        ConfigurationError: A table's retention is shorter than the job's replay horizon
            (`check_retention`): its checkpoint would drop app transactions a replay needs.
    """
    options = options or Options()
    ctx.prepare()
    if not options.dry_run:
        # Each table's commit records are kept beside its log first: the retention check
        # below then counts only the entries whose records the log alone holds.
        for group in ctx.groups:
            keep = getattr(group, "keep_log_records", None)
            if keep is not None:
                keep()
    ctx.check_retention()
    taken: list[int] = []

    def fence() -> int:
        # The job's fence, as a run takes it: a new epoch claimed in every sink, so no older
        # run can commit the files it wrote. Taken once per maintenance run.
        if not taken:
            taken.append(ctx.start(run_id or f"maintain-{uuid.uuid4().hex}"))
        return taken[0]

    tables = []
    for group in ctx.groups:
        # Groups whose storage needs upkeep (Delta tables) say so by having `maintain`.
        upkeep = getattr(group, "maintain", None)
        if upkeep is None:
            continue
        only_record = not any(g.keeps_window_records for g in ctx.groups if g is not group)
        tables.extend(
            upkeep(
                lambda table: downstream_holds(ctx.dsn, table, jobs, ctx.settings),
                fence=fence,
                options=options,
                log_is_only_record=only_record,
            )
        )
    # The ledger's per-window detail past the horizon: after the tables, so a maintenance
    # run that failed on a table leaves the ledger as it was.
    detail = prune_detail(ctx, options.keep_detail, options.dry_run)
    return MaintainResult(ctx.job.name, options.dry_run, tuple(tables), detail)
