"""The PostgreSQL sinks' quality targets: each table's rules, checked in the database, with the
row count its commit markers say it holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from psycopg import sql

from onceflow.errors import ConfigurationError
from onceflow.quality.results import CheckResult
from onceflow.quality.suites import (
    BATCH_SENTINEL,
    CheckSpec,
    SuiteSpec,
    check_names,
    column_checks,
    columns_sql,
    ge_query,
)
from onceflow.quality.target import CheckRun, Target

if TYPE_CHECKING:
    from onceflow.job import Job
    from onceflow.sinks.postgres.spec import PostgresSink

# A marker's rows_written is the rows its window added to the table (an upsert that replaces a
# row adds none); a restatement's is its net change.
_MARKER_ROWS = """
SELECT (coalesce((SELECT sum(rows_written) FROM onceflow.sink_commits
                  WHERE job = %(job)s AND sink = %(sink)s), 0)
      + coalesce((SELECT sum(rows_written) FROM onceflow.restate_commits
                  WHERE job = %(job)s AND sink = %(sink)s), 0)
      + coalesce((SELECT sum(rows_written) FROM onceflow.sink_commits_folded
                  WHERE job = %(job)s AND sink = %(sink)s), 0))::bigint
"""


@dataclass(frozen=True)
class PostgresTableTarget:
    """A PostgreSQL sink table and the rules its rows must satisfy.

    Attributes:
        sink: The sink's name in the job and in its commit markers.
        schema: The table's schema.
        table: The table's name.
        key: Columns that identify a row; no two rows may share them.
        expected_rows_from: `"markers"` when the table's row count must equal the sum of
            `rows_written` over the sink's commit markers (append-only sinks), `"none"` when the
            row count is not derived from the markers (upsert and accumulate sinks).
        not_null: Columns that must hold no NULL.
        regex: Column name to the regular expression every non-NULL value must match.
        row_filter: Column name to value; only rows equal on all of them belong to this target
            (for a table shared by several jobs, such as `onceflow.quarantine`).
    """

    sink: str
    schema: str
    table: str
    key: tuple[str, ...]
    expected_rows_from: Literal["markers", "none"]
    not_null: tuple[str, ...] = ()
    regex: dict[str, str] = field(default_factory=dict)
    row_filter: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_names([self.schema, self.table], "table name")
        if not self.key:
            raise ConfigurationError(f"sink {self.sink!r}: key must name at least one column")
        check_names((*self.key, *self.not_null, *self.regex, *self.row_filter), "column")
        for value in self.row_filter.values():
            if ":" in value or "\x00" in value:
                raise ConfigurationError(
                    f"sink {self.sink!r}: row_filter values must not hold ':' or NUL"
                )
        if self.expected_rows_from not in ("markers", "none"):
            raise ConfigurationError(
                f"sink {self.sink!r}: expected_rows_from must be 'markers' or 'none'"
            )

    def check(self, run: CheckRun) -> tuple[str, list[CheckResult]]:
        expected: int | None = None
        if self.expected_rows_from == "markers":
            row = run.conn.execute(_MARKER_ROWS, {"job": run.job, "sink": self.sink}).fetchone()
            expected = int(row[0]) if row else 0
        suite = postgres_table_suite(run.job, self, expected)
        outcomes = run.session.validate_query(suite, relation_query(self))
        return suite.name, run.results(outcomes, self.sink)


@dataclass(frozen=True)
class SumConsistency:
    """An accumulated table that must equal an aggregate of its source table.

    Every group in `balances` must hold the sum of `amount_col` and the row count of its
    group in `source`, and each side must have no group the other lacks.

    Attributes:
        sink: The accumulated table's sink name.
        balances: `(schema, table)` of the accumulated table.
        group_keys: Columns that identify a group in both tables (never NULL).
        total_col: The column of `balances` that holds the sum.
        count_col: The column of `balances` that holds the row count.
        source: `(schema, table)` of the table the sums are taken over.
        amount_col: The column of `source` that is summed.
    """

    sink: str
    balances: tuple[str, str]
    group_keys: tuple[str, ...]
    total_col: str
    count_col: str
    source: tuple[str, str]
    amount_col: str

    def __post_init__(self) -> None:
        check_names(list(self.balances) + list(self.source), "table name")
        if not self.group_keys:
            raise ConfigurationError(
                f"sink {self.sink!r}: group_keys must name at least one column"
            )
        check_names((*self.group_keys, self.total_col, self.count_col, self.amount_col), "column")

    def check(self, run: CheckRun) -> tuple[str, list[CheckResult]]:
        suite = sum_consistency_suite(run.job, self)
        outcomes = run.session.validate_query(suite, balances_relation_query(self))
        return suite.name, run.results(outcomes, self.sink)


def relation_query(target: PostgresTableTarget) -> str:
    """Return the `SELECT` that defines a PostgreSQL target's rows (its GE query asset).

    Args:
        target: The target.

    Returns:
        `SELECT * FROM schema.table`, restricted by the target's `row_filter`.
    """
    query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(target.schema, target.table))
    if target.row_filter:
        conditions = sql.SQL(" AND ").join(
            sql.SQL("{} = {}").format(sql.Identifier(column), sql.Literal(value))
            for column, value in sorted(target.row_filter.items())
        )
        query = sql.SQL("{} WHERE {}").format(query, conditions)
    return query.as_string()


def postgres_table_suite(
    job: str, target: PostgresTableTarget, expected_rows: int | None
) -> SuiteSpec:
    """Return the suite for a PostgreSQL table target.

    Args:
        job: The job's name.
        target: The target.
        expected_rows: The row count the ledger expects, or None when the target has none.

    Returns:
        Key uniqueness (pushed down as one `GROUP BY … HAVING count(*) > 1` query), the row
        count when expected, and the column rules.
    """
    keys = ", ".join(target.key)
    # Only the copy counts come back, never the keys: a payment id is sensitive data.
    duplicates = sql.SQL(
        "SELECT count(*) AS copies FROM {batch} GROUP BY {keys} HAVING count(*) > 1"
    )
    checks = [
        CheckSpec(
            check="keys_unique",
            kind="unexpected_rows",
            description=f"{target.sink}: no two rows share ({keys})",
            observed_key="duplicate_keys",
            query=ge_query(
                duplicates.format(batch=sql.SQL(BATCH_SENTINEL), keys=columns_sql(target.key))
            ),
        )
    ]
    if expected_rows is not None:
        checks.append(
            CheckSpec(
                check="row_count",
                kind="row_count",
                description=(
                    f"{target.sink}: row count equals the rows written by its commit markers"
                ),
                observed_key="rows",
                value=expected_rows,
            )
        )
    checks += column_checks(target.sink, target.not_null, target.regex)
    return SuiteSpec(name=f"{job}.{target.sink}", sink=target.sink, checks=tuple(checks))


def sum_consistency_suite(job: str, target: SumConsistency) -> SuiteSpec:
    """Return the suite that proves an accumulated table equals the aggregate of its source.

    Args:
        job: The job's name.
        target: The consistency rule.

    Returns:
        One unexpected-rows check: a FULL JOIN of the balances with the source aggregated by
        group, keeping groups missing on either side or differing in sum or count.
    """
    keys = target.group_keys
    on = sql.SQL(" AND ").join(
        sql.SQL("b.{k} = p.{k}").format(k=sql.Identifier(key)) for key in keys
    )
    query = sql.SQL(
        "SELECT b.onceflow_present AS has_balance, p.onceflow_present AS has_source "
        "FROM (SELECT {keys}, {total} AS onceflow_total, {count} AS onceflow_count, "
        "true AS onceflow_present FROM {batch} AS balances) AS b "
        "FULL JOIN (SELECT {keys}, sum({amount}) AS onceflow_total, "
        "count(*) AS onceflow_count, true AS onceflow_present FROM {source} GROUP BY {keys}) AS p "
        "ON {on} "
        "WHERE b.onceflow_present IS NULL OR p.onceflow_present IS NULL "
        "OR b.onceflow_total IS DISTINCT FROM p.onceflow_total "
        "OR b.onceflow_count IS DISTINCT FROM p.onceflow_count"
    ).format(
        keys=columns_sql(keys),
        total=sql.Identifier(target.total_col),
        count=sql.Identifier(target.count_col),
        batch=sql.SQL(BATCH_SENTINEL),
        amount=sql.Identifier(target.amount_col),
        source=sql.Identifier(*target.source),
        on=on,
    )
    source = ".".join(target.source)
    check = CheckSpec(
        check="sum_consistency",
        kind="unexpected_rows",
        description=(
            f"{target.sink}: every ({', '.join(keys)}) group holds sum({target.amount_col}) and "
            f"count(*) of {source}, and neither side has a group the other lacks"
        ),
        observed_key="mismatched_groups",
        query=ge_query(query),
    )
    return SuiteSpec(name=f"{job}.{target.sink}.sum_consistency", sink=target.sink, checks=(check,))


def balances_relation_query(target: SumConsistency) -> str:
    """Return the `SELECT` over the accumulated table (the GE query asset of its suite)."""
    return sql.SQL("SELECT * FROM {}").format(sql.Identifier(*target.balances)).as_string()


def quality_targets(specs: Sequence[PostgresSink], job: Job) -> list[Target]:
    """The targets of a job's PostgreSQL sinks: each keyed table's rules, and the sums the
    job's metadata declares between two of its tables."""
    by_name = {spec.name: spec for spec in specs}
    regex: dict[str, str] = dict(job.metadata.get("regex", {}))
    targets: list[Target] = [
        PostgresTableTarget(
            sink=spec.name,
            schema=spec.schema,
            table=spec.table,
            key=spec.key,
            expected_rows_from="none" if spec.mode == "accumulate" else "markers",
            not_null=spec.key,
            regex={c: p for c, p in regex.items() if c in spec.columns},
            row_filter={spec.job_column: job.name} if spec.job_column else {},
        )
        for spec in specs
        if spec.key
    ]
    for sink_name, rule in dict(job.metadata.get("sums", {})).items():
        balances = by_name.get(sink_name)
        source = by_name.get(rule["source_sink"])
        if balances is None or source is None:
            continue
        targets.append(
            SumConsistency(
                sink=sink_name,
                balances=(balances.schema, balances.table),
                group_keys=balances.key,
                total_col=rule["total"],
                count_col=rule["count"],
                source=(source.schema, source.table),
                amount_col=rule["amount"],
            )
        )
    return targets
