"""The lineage view `onceflow.lineage`: what proves each window was delivered once.

One row per (job, window): its offsets, the rows it read, kept, found duplicated and
quarantined (the ledger's stats), each sink's commit of it as the ledger records it when it
completes the window, whatever the sink's kind (the version of the sink's data holding it, the
id of the commit that wrote it, its rows; the sinks' own records stay the truth), and the latest
quality checks that covered it. A dashboard, `onceflow
status --json` and the Dagster metadata all read this one view, so they cannot disagree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from psycopg import sql

from onceflow._plans_folded import Plan, unfold

if TYPE_CHECKING:
    import psycopg

    from onceflow.quality.results import CheckResult

SCHEMA = "onceflow"
VIEW = "lineage"
# Bumped whenever the view's definition changes: the view is replaced only then, so the
# start-up of every run and sensor tick does not rewrite the catalog.
VIEW_VERSION = "onceflow.lineage v2"
# Validations whose check results are kept per job (older ones are covered by newer ones).
KEPT_VALIDATIONS = 100

_TABLES = """
CREATE TABLE IF NOT EXISTS onceflow.check_results (
    id bigserial PRIMARY KEY,
    job text NOT NULL,
    validation_id text NOT NULL,
    sink text NOT NULL,
    check_name text NOT NULL,
    passed boolean NOT NULL,
    through_window bigint NOT NULL,
    checked_at timestamptz NOT NULL DEFAULT now(),
    detail jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS check_results_by_window
    ON onceflow.check_results (job, through_window);
"""

# Each lateral subquery reads one window's rows by index, so `WHERE job = … ORDER BY window_id
# DESC LIMIT n` costs n lookups however many windows a job has.
_VIEW = """
SELECT w.job,
       w.window_id,
       w.epoch,
       w.offsets,
       w.planned_at,
       w.completed_at,
       w.skip_reason,
       (w.stats ->> 'rows_in')::bigint AS rows_in,
       (w.stats ->> 'kept')::bigint AS rows_out,
       (w.stats ->> 'duplicates')::bigint AS duplicates,
       (w.stats ->> 'quarantined')::bigint AS quarantined,
       coalesce(w.stats -> 'outputs', '{{}}'::jsonb) AS rows_by_output,
       coalesce(c.data_versions, '{{}}'::jsonb) AS data_versions,
       coalesce(c.commit_refs, '{{}}'::jsonb) AS commit_refs,
       coalesce(c.rows_committed, '{{}}'::jsonb) AS rows_committed,
       q.checks,
       q.checks_failed,
       CASE WHEN q.checks = 0 THEN NULL ELSE q.checks_failed = 0 END AS checks_passed,
       q.checked_at
FROM {windows} w
LEFT JOIN LATERAL (
    SELECT jsonb_object_agg(v.sink, v.version) FILTER (WHERE v.version IS NOT NULL)
               AS data_versions,
           jsonb_object_agg(v.sink, v.commit_ref) FILTER (WHERE v.commit_ref IS NOT NULL)
               AS commit_refs,
           jsonb_object_agg(v.sink, v.rows_written) FILTER (WHERE v.rows_written IS NOT NULL)
               AS rows_committed
    FROM {commits} v WHERE v.job = w.job AND v.window_id = w.window_id
) c ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS checks,
           count(*) FILTER (WHERE NOT latest.passed) AS checks_failed,
           max(latest.checked_at) AS checked_at
    FROM (SELECT DISTINCT ON (r.sink, r.check_name) r.passed, r.checked_at
          FROM {checks} r
          WHERE r.job = w.job AND r.through_window >= w.window_id
          ORDER BY r.sink, r.check_name, r.id DESC) latest
) q ON true
"""


def _ident(name: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA, name)


@dataclass(frozen=True)
class LineageRow:
    """One window of a job, from source offsets to every sink's commit and the latest checks.

    Attributes:
        job: The job's name.
        window_id: The window.
        epoch: The epoch of the run that planned it.
        offsets: Its source offsets, as planned.
        planned_at: When it was written ahead into the ledger.
        completed_at: When every sink held it (None while pending).
        skipped: The operator's reason, when it was skipped.
        rows_in: Records read (None until counted).
        rows_out: Valid records kept after deduplication.
        duplicates: Valid records dropped as duplicates.
        quarantined: Invalid records sent to the quarantine.
        rows_by_output: Rows of each transform output.
        data_versions: Sink → the version of its data holding the window, for kinds that
            version their data (a Delta table version).
        commit_refs: Sink → the id of the commit that wrote the window, for kinds that have
            one (a PostgreSQL transaction id; one transaction commits every PostgreSQL sink).
        rows_committed: Sink → rows that commit wrote.
        checks: Quality checks in the latest results covering the window (0: none yet).
        checks_failed: How many of them failed.
        checks_passed: Whether they all passed (None when no check covered the window yet).
        checked_at: When the newest of them ran.
    """

    job: str
    window_id: int
    epoch: int
    offsets: dict[str, Any]
    planned_at: datetime
    completed_at: datetime | None
    skipped: str | None
    rows_in: int | None
    rows_out: int | None
    duplicates: int | None
    quarantined: int | None
    rows_by_output: dict[str, int]
    data_versions: dict[str, int]
    commit_refs: dict[str, str]
    rows_committed: dict[str, int]
    checks: int
    checks_failed: int
    checks_passed: bool | None
    checked_at: datetime | None

    def as_json(self) -> dict[str, Any]:
        """Plain JSON-serialisable data (timestamps in ISO 8601)."""
        out = dict(self.__dict__)
        for key in ("planned_at", "completed_at", "checked_at"):
            value = out[key]
            out[key] = value.isoformat() if value is not None else None
        return out


def ensure_view(conn: psycopg.Connection) -> None:
    """Create the lineage view and the check results' table (inside the caller's transaction,
    after the ledger's tables)."""
    ensure_results_table(conn)
    row = conn.execute(
        "SELECT obj_description(to_regclass(%s), 'pg_class')", (f"{SCHEMA}.{VIEW}",)
    ).fetchone()
    if row is not None and row[0] == VIEW_VERSION:
        return
    view = _ident(VIEW)
    body = sql.SQL(_VIEW).format(
        windows=_ident("windows"),
        commits=_ident("sink_versions"),
        checks=_ident("check_results"),
    )
    # DROP first: CREATE OR REPLACE cannot change a view's columns.
    conn.execute(sql.SQL("DROP VIEW IF EXISTS {}").format(view))
    conn.execute(sql.SQL("CREATE VIEW {} AS {}").format(view, body))
    conn.execute(sql.SQL("COMMENT ON VIEW {} IS {}").format(view, sql.Literal(VIEW_VERSION)))


def read_lineage(conn: psycopg.Connection, job: str, *, limit: int = 20) -> list[LineageRow]:
    """The job's newest `limit` windows, newest first, from the view."""
    query = sql.SQL(
        "SELECT job, window_id, epoch, offsets, planned_at, completed_at, skip_reason, rows_in,"
        " rows_out, duplicates, quarantined, rows_by_output, data_versions, commit_refs, rows_committed,"
        " checks, checks_failed, checks_passed, checked_at"
        " FROM {} WHERE job = %s ORDER BY window_id DESC LIMIT %s"
    ).format(_ident(VIEW))
    fetched = conn.execute(query, (job, limit)).fetchall()
    # A window folded past the detail horizon has its plan and stats in its folded row.
    plans = unfold(conn, job, [int(r[1]) for r in fetched if r[3] is None])
    rows = [_unfolded(r, plans) for r in fetched]
    return [
        LineageRow(
            job=str(r[0]),
            window_id=int(r[1]),
            epoch=int(r[2]),
            offsets=dict(r[3]),
            planned_at=r[4],
            completed_at=r[5],
            skipped=r[6],
            rows_in=_opt_int(r[7]),
            rows_out=_opt_int(r[8]),
            duplicates=_opt_int(r[9]),
            quarantined=_opt_int(r[10]),
            rows_by_output={str(k): int(v) for k, v in dict(r[11]).items()},
            data_versions={str(k): int(v) for k, v in dict(r[12]).items()},
            commit_refs={str(k): str(v) for k, v in dict(r[13]).items()},
            rows_committed={str(k): int(v) for k, v in dict(r[14]).items()},
            checks=int(r[15]),
            checks_failed=int(r[16]),
            checks_passed=r[17],
            checked_at=r[18],
        )
        for r in rows
    ]


def _unfolded(row: tuple[Any, ...], plans: Mapping[int, Plan]) -> tuple[Any, ...]:
    """The view's row of a folded window with its plan and the counts of its stats."""
    if row[3] is not None:
        return row
    plan = plans[int(row[1])]
    stats = plan.stats or {}
    counts = [stats.get(k) for k in ("rows_in", "kept", "duplicates", "quarantined")]
    return (*row[:3], plan.offsets, *row[4:7], *counts, stats.get("outputs") or {}, *row[12:])


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def lineage(dsn: str, job: str, *, limit: int = 20) -> list[LineageRow]:
    """The job's newest `limit` windows from `onceflow.lineage`, newest first.

    Args:
        dsn: The database holding the ledger (never logged).
        job: The job's name.
        limit: How many windows.

    Returns:
        Empty when the ledger or the view does not exist yet (the job never ran).
    """
    from onceflow.postgres import connect, retrying

    def read() -> list[LineageRow]:
        with connect(dsn, autocommit=True) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.{VIEW}",)).fetchone()
            if found is None or found[0] is None:
                return []
            return read_lineage(conn, job, limit=limit)

    return retrying(read, what=f"read the lineage of {job}", dsn=dsn)


def completed_through(conn: psycopg.Connection, job: str) -> int:
    """The newest window the ledger marks completed (0 when none, or no ledger yet)."""
    ledger = conn.execute("SELECT to_regclass('onceflow.windows')").fetchone()
    if ledger is None or ledger[0] is None:
        return 0
    row = conn.execute(
        "SELECT coalesce(max(window_id), 0) FROM onceflow.windows"
        " WHERE job = %s AND completed_at IS NOT NULL",
        (job,),
    ).fetchone()
    return int(row[0]) if row else 0


def record_check_results(
    conn: psycopg.Connection, job: str, results: Sequence[CheckResult], through_window: int
) -> str:
    """Store one validation's results (counts only, never row values); return its id.

    `through_window` is the newest window the ledger had completed before the checks ran
    (`completed_through`): the windows the results speak for. Only the newest
    KEPT_VALIDATIONS validations of a job are kept.
    """
    validation_id = uuid.uuid4().hex
    if not results:
        return validation_id
    ensure_results_table(conn)
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO onceflow.check_results (job, validation_id, sink, check_name, passed,"
            " through_window, detail) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            [
                (
                    job,
                    validation_id,
                    r.sink,
                    r.check,
                    r.passed,
                    through_window,
                    json.dumps(r.observed),
                )
                for r in results
            ],
        )
    conn.execute(
        "DELETE FROM onceflow.check_results WHERE job = %s AND validation_id IN ("
        " SELECT validation_id FROM onceflow.check_results WHERE job = %s"
        " GROUP BY validation_id ORDER BY max(id) DESC OFFSET %s)",
        (job, job, KEPT_VALIDATIONS),
    )
    return validation_id


def ensure_results_table(conn: psycopg.Connection) -> None:
    """The check results' table, when it is missing. Checked first: `CREATE INDEX IF NOT
    EXISTS` takes a lock even when the index exists, and this runs at the start of every run
    and tick."""
    row = conn.execute("SELECT to_regclass('onceflow.check_results') IS NOT NULL").fetchone()
    if row is not None and row[0]:
        return
    conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
    conn.execute("CREATE SCHEMA IF NOT EXISTS onceflow")
    conn.execute(_TABLES)
