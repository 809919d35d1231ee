"""The ledger's per-window detail past the job's detail horizon: dropped, with a summary kept.

Some per-window rows serve only a look back at old windows: the lineage rows
(`onceflow.sink_versions`: which version of each sink holds a window) and an accumulating sink's
contributions (what a window added, read only to restate it). Kept for every window ever, they
grow with the history. A maintenance run drops them for the windows through the detail horizon:

- the newest window planned more than `Options.keep_detail` ago (default 30 days),
- below every window not yet completed or skipped (a run or a replay still works on it),
- below every unfinished restatement (it reads its window's contribution).

The lineage rows dropped are summed per sink (`onceflow.detail_pruned`: windows, rows written,
the last version) and the point is recorded there; a restatement of a window through it is
refused where it needed what was dropped. It runs in one transaction that holds the job's row,
as every commit does: no commit or restatement of the job runs between the horizon read and
the drop, and a restatement's commit that comes after it sees the point (it checks again under
that row).

What the recovery paths read stays: the windows' plans and units, the key index (a start-up,
a replay, a reconcile and a rebuild need them whatever the age), and the sinks' commit
records. Two of them are folded into a row per run of windows that answers every reader of
them: a PostgreSQL sink's markers (`SinkGroup.fold_records`, `onceflow.sinks.postgres._folded`)
and the windows' plans and stats (`onceflow._plans_folded`; each window keeps its row).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow import _plans_folded as plans_folded
from onceflow import faults
from onceflow.postgres import retrying

if TYPE_CHECKING:
    from onceflow.window.context import JobContext

# The newest window planned before the cutoff (by the planned-time index), below every open
# window (by the partial index of open windows) and every unfinished restatement; and the
# horizon already kept for every sink of the job (0 while one has none).
_HORIZON = """
SELECT least(
    coalesce((SELECT window_id FROM onceflow.windows
              WHERE job = %(job)s AND planned_at < now() - %(keep)s::interval
              ORDER BY planned_at DESC, window_id DESC LIMIT 1), 0),
    (SELECT min(window_id) - 1 FROM onceflow.windows
     WHERE job = %(job)s AND completed_at IS NULL AND skipped_at IS NULL),
    (SELECT min(window_id) - 1 FROM onceflow.restatements
     WHERE job = %(job)s AND completed_at IS NULL AND cancelled_at IS NULL)
),
(SELECT CASE WHEN count(*) < cardinality(%(sinks)s::text[]) THEN 0 ELSE min(through) END
 FROM onceflow.detail_pruned WHERE job = %(job)s AND sink = ANY(%(sinks)s))
"""


@dataclass(frozen=True)
class DetailPruned:
    """What a maintenance run dropped (or, dry, would drop) of the ledger's per-window detail.

    Attributes:
        through: The detail horizon: windows through it keep no per-window detail (0: none).
        before: The horizon before this run.
        lineage_rows: `sink_versions` rows dropped (summed into `onceflow.detail_pruned`).
        contribution_rows: Accumulating sinks' contribution rows dropped.
        folded_records: Commit records folded into range rows (PostgreSQL sinks' markers).
        folded_plans: Windows whose plan and stats were folded into range rows.
    """

    through: int
    before: int
    lineage_rows: int = 0
    contribution_rows: int = 0
    folded_records: int = 0
    folded_plans: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "through": self.through,
            "before": self.before,
            "lineage_rows": self.lineage_rows,
            "contribution_rows": self.contribution_rows,
            "folded_records": self.folded_records,
            "folded_plans": self.folded_plans,
        }

    def line(self, dry_run: bool) -> str:
        if self.through <= self.before:
            return f"ledger detail: kept (horizon at window {self.before})"
        verb = "would drop" if dry_run else "dropped"
        return (
            f"ledger detail: {verb} windows {self.before + 1}..{self.through}'s "
            f"{self.lineage_rows} lineage row(s) and {self.contribution_rows} contribution "
            f"row(s) (their sums kept in onceflow.detail_pruned); "
            f"{'would fold' if dry_run else 'folded'} {self.folded_records} commit marker(s) "
            f"and {self.folded_plans} window plan(s) into range rows"
        )


# Windows dropped per transaction: each holds the job's row, which a commit of the job waits
# for, so a first drop over a long history is cut into short ones.
CHUNK = 5_000


def prune_detail(ctx: JobContext, keep: timedelta, dry_run: bool) -> DetailPruned:
    """Drop the per-window detail of `ctx.job`'s windows past its detail horizon, `CHUNK`
    windows a transaction (a dry run does it all in one and rolls it back, holding no lock).
    Each is done again after a lost connection: one whose COMMIT applied moved the point."""
    sinks = [spec.name for group in ctx.groups for spec in group.specs]

    def attempt() -> tuple[DetailPruned, int]:
        """One transaction's part, and the horizon it read."""
        # A session named for the job without an epoch: a run that needs the job's row while
        # this one is frozen holding it ends it (`Ledger.acquire_epoch`), so maintenance never
        # stalls a run; what it rolls back is done by the next maintenance.
        with ctx.ledger.connect() as conn, conn.transaction(force_rollback=dry_run):
            lock = sql.SQL("" if dry_run else " FOR UPDATE")
            owner = conn.execute(
                sql.SQL("SELECT 1 FROM onceflow.jobs WHERE job = %s{}").format(lock),
                (ctx.job.name,),
            ).fetchone()
            if owner is None:  # never run: nothing recorded
                return DetailPruned(0, 0), 0
            row = conn.execute(
                _HORIZON, {"job": ctx.job.name, "keep": keep, "sinks": sinks}
            ).fetchone()
            assert row is not None
            horizon, before = int(row[0] or 0), int(row[1] or 0)
            if horizon <= before:
                return DetailPruned(before, before), horizon
            through = horizon if dry_run else min(horizon, before + CHUNK)
            if not dry_run:
                faults.point("prune_locked")
            dropped = sum(group.forget_detail(conn, through) for group in ctx.groups)
            folded = sum(group.fold_records(conn, through) for group in ctx.groups)
            plans = plans_folded.fold(conn, ctx.job.name, through)
            lineage = _fold_lineage(conn, ctx.job.name, sinks, through)
            return DetailPruned(through, before, lineage, dropped, folded, plans), horizon

    what = f"drop the ledger's detail (job {ctx.job.name})"
    done, horizon = retrying(attempt, what=what, dsn=ctx.dsn)
    before, total = done.before, done
    while done.through < horizon:  # a horizon read lower meanwhile (a restatement) ends it
        done, horizon = retrying(attempt, what=what, dsn=ctx.dsn)
        total = DetailPruned(
            done.through,
            before,
            total.lineage_rows + done.lineage_rows,
            total.contribution_rows + done.contribution_rows,
            total.folded_records + done.folded_records,
            total.folded_plans + done.folded_plans,
        )
    return DetailPruned(
        done.through,
        before,
        total.lineage_rows,
        total.contribution_rows,
        total.folded_records,
        total.folded_plans,
    )


def _fold_lineage(conn: psycopg.Connection, job: str, sinks: list[str], horizon: int) -> int:
    """Sum the lineage rows through `horizon` into each sink's summary, drop them, and record
    the horizon for every sink of the job (those without lineage rows too); return the rows
    dropped (counted by the statement that drops them)."""
    row = conn.execute(
        "WITH dropped AS (DELETE FROM onceflow.sink_versions WHERE job = %(job)s"
        "  AND window_id <= %(through)s RETURNING sink, version, rows_written),"
        " summed AS (SELECT s AS sink, count(d.sink) AS windows,"
        "  coalesce(sum(d.rows_written), 0) AS rows_written, max(d.version) AS last_version"
        "  FROM unnest(%(sinks)s::text[]) AS s LEFT JOIN dropped d ON d.sink = s GROUP BY s)"
        " , kept AS (INSERT INTO onceflow.detail_pruned AS p"
        "  (job, sink, through, windows, rows_written, last_version)"
        " SELECT %(job)s, sink, %(through)s, windows, rows_written, last_version FROM summed"
        " ON CONFLICT (job, sink) DO UPDATE SET through = greatest(p.through, excluded.through),"
        "  windows = p.windows + excluded.windows,"
        "  rows_written = p.rows_written + excluded.rows_written,"
        "  last_version = coalesce(excluded.last_version, p.last_version), pruned_at = now()"
        "  RETURNING 1)"
        " SELECT (SELECT count(*) FROM dropped), (SELECT count(*) FROM kept)",
        {"job": job, "through": horizon, "sinks": sinks},
    ).fetchone()
    return int(row[0]) if row else 0
