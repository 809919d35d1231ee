"""The Delta sinks' quality targets: a table's rules, measured in one Spark aggregation, with the
row count the ledger's window stats say the windows the table committed hold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from deltalake import DeltaTable
from psycopg import sql

from onceflow import _plans_folded as plans_folded
from onceflow._delta_read import open_table, read_table
from onceflow._identifiers import spark_sql_name
from onceflow.errors import ConfigurationError
from onceflow.quality.results import CheckResult
from onceflow.quality.suites import CheckSpec, SuiteSpec
from onceflow.quality.target import CheckRun
from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# Windows the Delta table holds are those up to its app-transaction version. A window in that
# range without the output in its stats, or missing from the ledger, leaves the expected count
# unknown, and that is reported rather than guessed. Skipped windows were held by no sink; a
# window abandoned for the sink is a known gap: its rows are left out of the expected count
# (and counted on their own as the gap's rows). A window folded past the detail horizon (NULL
# offsets) keeps its stats in its folded row: counted by `_plans_folded.output_sums`.
_DELTA_LEDGER = """
SELECT count(*)::bigint,
       count(*) FILTER (WHERE NOT w.gap
           AND jsonb_typeof(w.stats -> 'outputs' -> %(output)s) IS DISTINCT FROM 'number')::bigint,
       coalesce(sum((w.stats -> 'outputs' ->> %(output)s)::bigint) FILTER (WHERE NOT w.gap
           AND jsonb_typeof(w.stats -> 'outputs' -> %(output)s) = 'number'), 0)::bigint,
       coalesce(sum((w.stats -> 'outputs' ->> %(output)s)::bigint) FILTER (WHERE w.abandoned
           AND jsonb_typeof(w.stats -> 'outputs' -> %(output)s) = 'number'), 0)::bigint
FROM (SELECT stats, skipped_at IS NOT NULL OR a.window_id IS NOT NULL OR offsets IS NULL AS gap,
             a.window_id IS NOT NULL AND offsets IS NOT NULL AS abandoned
      FROM onceflow.windows
      LEFT JOIN {abandoned} a USING (job, window_id)
      WHERE job = %(job)s AND window_id <= %(version)s) w
"""


# A table that is gone has no app transaction left to say which windows it held; the windows the
# ledger marks completed must all have been there (but those abandoned for it).
_DELTA_LEDGER_COMPLETED = """
SELECT coalesce(sum((stats -> 'outputs' ->> %(output)s)::bigint) FILTER (
           WHERE jsonb_typeof(stats -> 'outputs' -> %(output)s) = 'number'), 0)::bigint
FROM onceflow.windows
LEFT JOIN {abandoned} a USING (job, window_id)
WHERE job = %(job)s AND completed_at IS NOT NULL AND a.window_id IS NULL AND offsets IS NOT NULL
"""


@dataclass(frozen=True)
class DeltaTableTarget:
    """A Delta table sink and the rules its rows must satisfy.

    Attributes:
        sink: The sink's name in the job.
        path: The table's root folder or URI.
        key: Columns that identify a row; no two rows may share them.
        expected_output: The output's name in the ledger's `stats.outputs`; the table must hold
            the sum of that count over the windows committed to it.
        app_id: The Delta application-transaction id the engine commits with; its version is the
            highest window committed to the table.
        not_null: Columns that must hold no NULL.
        regex: Column name to the regular expression every non-NULL value must match.
    """

    sink: str
    path: str
    key: tuple[str, ...]
    expected_output: str
    app_id: str
    not_null: tuple[str, ...] = ()
    regex: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.key:
            raise ConfigurationError(f"sink {self.sink!r}: key must name at least one column")

    def check(self, run: CheckRun) -> tuple[str, list[CheckResult]]:
        return _check_delta(self, run)


# Column names of the one-row aggregate computed on Spark for a Delta table.
AGG_ROWS = "rows"


AGG_DUPLICATE_KEYS = "duplicate_keys"


AGG_EXTRA_COPIES = "extra_copies"


def agg_nulls(column: str) -> str:
    """Return the aggregate column counting NULLs in `column`."""
    return f"nulls:{column}"


def agg_mismatches(column: str) -> str:
    """Return the aggregate column counting values of `column` that miss its pattern."""
    return f"mismatches:{column}"


def delta_aggregate_suite(job: str, target: DeltaTableTarget, expected_rows: int) -> SuiteSpec:
    """Return the suite run on the one-row aggregate of a Delta table.

    Args:
        job: The job's name.
        target: The target.
        expected_rows: The row count the ledger expects for the windows the table holds.

    Returns:
        Checks that the aggregate shows no duplicate key, the expected row count, no NULL in
        the not-null columns and no value that misses its pattern.
    """
    keys = ", ".join(target.key)
    checks = [
        CheckSpec(
            check="keys_unique",
            kind="value_equals",
            description=f"{target.sink}: no two rows share ({keys})",
            observed_key="duplicate_keys",
            column=AGG_DUPLICATE_KEYS,
            value=0,
        ),
        CheckSpec(
            check="row_count",
            kind="value_equals",
            description=(
                f"{target.sink}: row count equals the ledger's '{target.expected_output}' "
                "output over the windows committed to the table"
            ),
            observed_key="rows",
            column=AGG_ROWS,
            value=expected_rows,
        ),
    ]
    checks += [
        CheckSpec(
            check=f"not_null:{column}",
            kind="value_equals",
            description=f"{target.sink}: column {column} holds no NULL",
            observed_key="nulls",
            column=agg_nulls(column),
            value=0,
        )
        for column in target.not_null
    ]
    checks += [
        CheckSpec(
            check=f"regex:{column}",
            kind="value_equals",
            description=f"{target.sink}: every value of {column} matches {pattern}",
            observed_key="mismatches",
            column=agg_mismatches(column),
            value=0,
        )
        for column, pattern in target.regex.items()
    ]
    return SuiteSpec(name=f"{job}.{target.sink}", sink=target.sink, checks=tuple(checks))


def _spark_column(name: str) -> Any:
    from pyspark.sql import functions as F

    return F.col(spark_sql_name(name))


def _aggregate_delta(frame: DataFrame, target: DeltaTableTarget) -> dict[str, int]:
    """Measure a Delta table in one Spark job that returns a single row to the driver."""
    from pyspark.sql import functions as F

    nulls = {agg_nulls(c): f"n{i}" for i, c in enumerate(target.not_null)}
    misses = {agg_mismatches(c): f"m{i}" for i, c in enumerate(target.regex)}
    per_key = frame.groupBy(*[_spark_column(k) for k in target.key]).agg(
        F.count(F.lit(1)).alias("copies"),
        *[
            F.count_if(_spark_column(c).isNull()).alias(alias)
            for c, alias in zip(target.not_null, nulls.values(), strict=True)
        ],
        # rlike on NULL is NULL and so not counted: NULLs are the not-null check's business.
        *[
            F.count_if(~_spark_column(c).rlike(pattern)).alias(alias)
            for (c, pattern), alias in zip(target.regex.items(), misses.values(), strict=True)
        ],
    )
    row = per_key.agg(
        F.sum("copies").alias("rows"),
        F.count(F.lit(1)).alias("keys"),
        F.count_if(F.col("copies") > 1).alias("duplicate_keys"),
        *[F.sum(alias).alias(alias) for alias in [*nulls.values(), *misses.values()]],
    ).first()
    values = {name: int(value or 0) for name, value in (row.asDict() if row else {}).items()}
    measured = {
        AGG_ROWS: values.get("rows", 0),
        AGG_DUPLICATE_KEYS: values.get("duplicate_keys", 0),
        AGG_EXTRA_COPIES: values.get("rows", 0) - values.get("keys", 0),
    }
    for column, alias in {**nulls, **misses}.items():
        measured[column] = values.get(alias, 0)
    return measured


def _check_delta(target: DeltaTableTarget, run: CheckRun) -> tuple[str, list[CheckResult]]:
    job, conn = run.job, run.conn
    # Aggregated on Spark and the one-row aggregate validated by GE, rather than GE on a Spark
    # DataFrame datasource: GE runs a Spark job per metric (100k rows, 12 checks, 2 busy cores:
    # 6-8 s warm and 48 s cold, against 3-4 s and 7 s for this), while this is one Spark job
    # with one shuffle that returns a single row and never collects the table onto the driver.
    location = Location.parse(target.path)
    exists = DeltaTable.is_deltatable(location.uri, storage_options=location.delta_options())
    ledger: dict[str, int | float | str] = {}
    if exists:
        table = open_table(location)
        snapshot = table.version()
        committed = table.transaction_version(target.app_id)
        started = time.perf_counter()
        measured = _aggregate_delta(read_table(run.spark_session(), location, snapshot), target)
        run.timings[f"{job}.{target.sink}:spark"] = time.perf_counter() - started
        ledger["delta_version"] = snapshot
        ledger["committed_window"] = committed if committed is not None else 0
        with _snapshot(conn):  # the windows' rows and the folded ones as of one moment
            row = conn.execute(
                sql.SQL(_DELTA_LEDGER).format(abandoned=run.abandoned(target.sink)),
                {"job": job, "output": target.expected_output, "version": committed or 0},
            ).fetchone()
            folded = plans_folded.output_sums(
                conn, job, target.expected_output, _abandoned(run, target.sink), committed or 0
            )
        windows, without_stats, expected, gap_rows = (int(v) for v in row) if row else (0, 0, 0, 0)
        without_stats += folded.without_count
        expected += folded.rows
        gap_rows += folded.abandoned_rows
        ledger["windows_missing_from_ledger"] = (committed or 0) - windows
        ledger["windows_without_stats"] = without_stats
        if gap_rows:
            ledger["abandoned_rows"] = gap_rows
    else:
        measured = {AGG_ROWS: 0, AGG_DUPLICATE_KEYS: 0, AGG_EXTRA_COPIES: 0}
        measured.update({agg_nulls(c): 0 for c in target.not_null})
        measured.update({agg_mismatches(c): 0 for c in target.regex})
        with _snapshot(conn):
            row = conn.execute(
                sql.SQL(_DELTA_LEDGER_COMPLETED).format(abandoned=run.abandoned(target.sink)),
                {"job": job, "output": target.expected_output},
            ).fetchone()
            folded = plans_folded.output_sums(
                conn, job, target.expected_output, _abandoned(run, target.sink)
            )
        expected = (int(row[0]) if row else 0) + folded.rows
        ledger["table_missing"] = 1
    suite = delta_aggregate_suite(job, target, expected)

    import pandas as pd

    results = []
    for result in run.results(
        run.session.validate_frame(suite, pd.DataFrame([measured])), target.sink
    ):
        if result.check == "keys_unique":
            result.observed["extra_copies"] = measured[AGG_EXTRA_COPIES]
        elif result.check == "row_count":
            result.observed.update(ledger)
            ledger_whole = not ledger.get("windows_missing_from_ledger") and not ledger.get(
                "windows_without_stats"
            )
            if not ledger_whole:
                result = CheckResult(
                    sink=result.sink,
                    check=result.check,
                    passed=False,
                    observed=result.observed,
                    description=result.description + " (the ledger lacks windows or stats)",
                )
        results.append(result)
    return suite.name, results


def _abandoned(run: CheckRun, sink: str) -> set[int]:
    """The job's windows abandoned for `sink`."""
    rows = run.conn.execute(
        sql.SQL("SELECT window_id FROM {} a WHERE a.job = %s").format(run.abandoned(sink)),
        (run.job,),
    ).fetchall()
    return {int(w) for (w,) in rows}


@contextmanager
def _snapshot(conn: psycopg.Connection) -> Iterator[None]:
    """One read-only snapshot for the statements inside: a maintenance folding windows
    between them would have them counted in the rows and in the folded sums both."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield
