"""What a quality target is: a sink's rules that check themselves against the sink.

Each kind of sink defines its targets in its own package (the rows it holds, how many the ledger
or its commit records say it should hold); `validate` only hands each one a `CheckRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from psycopg import sql

from onceflow.quality.results import CheckResult

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import SparkSession

    from onceflow.quality._gx import GxSession, Outcome


@dataclass
class CheckRun:
    """What a target's checks run with: one validation of one job.

    Attributes:
        job: The job's name, as recorded in the ledger.
        session: The Great Expectations session the suites run in.
        conn: An autocommit connection to the database holding the ledger.
        spark_session: Opens the Spark session (only a target that reads with Spark asks).
        timings: Wall-clock seconds of parts of a suite (`<suite>:spark`), filled by targets.
    """

    job: str
    session: GxSession
    conn: psycopg.Connection
    spark_session: Callable[[], SparkSession]
    timings: dict[str, float] = field(default_factory=dict)

    def abandoned(self, sink: str) -> sql.Composable:
        """The windows abandoned for `sink` (job, window_id), as a relation to join."""
        row = self.conn.execute("SELECT to_regclass('onceflow.abandoned_windows')").fetchone()
        if row is None or row[0] is None:  # a ledger older than abandonment
            return sql.SQL("(SELECT NULL::text AS job, NULL::bigint AS window_id WHERE false)")
        return sql.SQL(
            "(SELECT job, window_id FROM onceflow.abandoned_windows WHERE sink = {})"
        ).format(sql.Literal(sink))

    def results(self, outcomes: list[Outcome], sink: str) -> list[CheckResult]:
        """The suite's outcomes as the report's results."""
        return [
            CheckResult(
                sink=sink,
                check=o.spec.check,
                passed=o.success,
                observed=o.observed,
                description=o.spec.description,
            )
            for o in outcomes
        ]


class Target(Protocol):
    """A sink's rules: `check` runs its suite and names it."""

    @property
    def sink(self) -> str: ...

    def check(self, run: CheckRun) -> tuple[str, list[CheckResult]]:
        """Run the target's suite; return its name and one result per check."""
        ...
