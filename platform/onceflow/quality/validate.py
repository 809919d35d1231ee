"""Runs a job's quality suites against its sinks and reports every check by sink and name."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from onceflow.lineage import completed_through, record_check_results
from onceflow.quality._gx import GxSession
from onceflow.quality.results import CheckResult, ValidationReport
from onceflow.quality.target import CheckRun, Target

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def abandoned_windows(conn: psycopg.Connection, job: str) -> dict[str, list[tuple[int, str]]]:
    """Sink → (window id, reason) of the windows abandoned for it (none on an older ledger)."""
    row = conn.execute("SELECT to_regclass('onceflow.abandoned_windows')").fetchone()
    if row is None or row[0] is None:
        return {}
    out: dict[str, list[tuple[int, str]]] = {}
    for wid, sink, reason in conn.execute(
        "SELECT window_id, sink, reason FROM onceflow.abandoned_windows WHERE job = %s"
        " ORDER BY window_id",
        (job,),
    ):
        out.setdefault(str(sink), []).append((int(wid), str(reason)))
    return out


def _known_gap(sink: str, gaps: list[tuple[int, str]]) -> CheckResult:
    """A passing result that names a sink's abandoned windows: a known gap, never a silent one."""
    from onceflow.windows import format_windows

    return CheckResult(
        sink=sink,
        check="abandoned_windows",
        passed=True,
        observed={
            "windows": format_windows([w for w, _ in gaps]),
            "count": len(gaps),
            "reasons": "; ".join(f"window {w}: {r}" for w, r in gaps),
        },
        description=(
            f"{sink}: completed windows an operator abandoned for this sink (their input is "
            "gone); their rows are not expected here"
        ),
    )


def validate(
    job: str,
    targets: Sequence[Target],
    *,
    dsn: str,
    spark: SparkSession | None = None,
    data_docs_dir: Path | None = None,
) -> ValidationReport:
    """Run the quality suites of a job's sinks.

    Each target checks itself (its kind's package defines it); expected row counts come from
    the same database: the commit markers' `rows_written` for PostgreSQL sinks, the ledger's
    window stats up to the Delta app-transaction version for Delta sinks. Run it when the job has caught up: a run committing meanwhile can make
    the ledger and a sink disagree for a moment.

    Args:
        job: The job's name, as recorded in the ledger.
        targets: The sinks and rules to check.
        dsn: libpq DSN or URI of the database holding the ledger and the PostgreSQL sinks.
            It is never logged or copied into results or Data Docs.
        spark: The session for targets that read with Spark (Delta tables); onceflow's
            default local session when None and one asks for it.
        data_docs_dir: When given, a GE file context rooted here keeps suites and results and
            renders Data Docs, whose index page the report returns.

    Returns:
        The report: one result per check.

    Raises:
        psycopg.Error: The ledger cannot be read.
    """
    opened: list[SparkSession] = [spark] if spark is not None else []

    def spark_session() -> SparkSession:
        if not opened:
            from onceflow.spark import build_spark_session

            opened.append(build_spark_session())
        return opened[0]

    session = GxSession(job, dsn=dsn, docs_dir=data_docs_dir)
    results: list[CheckResult] = []
    timings: dict[str, float] = {}
    through = 0
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            through = completed_through(conn, job)
            gaps = abandoned_windows(conn, job)
            named: set[str] = set()
            run = CheckRun(job, session, conn, spark_session, timings)
            for target in targets:
                started = time.perf_counter()
                name, found = target.check(run)
                timings[name] = time.perf_counter() - started
                results.extend(found)
                if target.sink in gaps and target.sink not in named:
                    named.add(target.sink)
                    results.append(_known_gap(target.sink, gaps[target.sink]))
            # Kept in the database for the lineage view: the latest checks covering a window.
            with conn.transaction():
                record_check_results(conn, job, results, through)
        docs = session.build_docs()
    finally:
        session.close()
    for result in results:
        if not result.passed:
            log.info("quality check failed: %s %s %s", result.sink, result.check, result.observed)
    return ValidationReport(
        job=job, results=results, data_docs=docs, timings=timings, through_window=through
    )
