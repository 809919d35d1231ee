"""Quality targets (what a job's sinks must satisfy) and the checks each one expands into."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from psycopg import sql

from onceflow.errors import ConfigurationError

# PostgreSQL truncates longer names silently, so two long names could meet in one table.
_MAX_IDENTIFIER_BYTES = 63

# GE fills `{batch}` with str.format, so every other brace in a query must be doubled; the
# sentinel marks where `{batch}` goes while psycopg renders the rest.
_BATCH_SENTINEL = f"onceflow_batch_{uuid.uuid4().hex}"

CheckKind = Literal["unexpected_rows", "row_count", "not_null", "regex", "value_equals"]


def _check_name(name: str, what: str) -> None:
    if not name:
        raise ConfigurationError(f"{what} must not be empty")
    if len(name.encode()) > _MAX_IDENTIFIER_BYTES:
        raise ConfigurationError(f"{what} {name!r} is longer than {_MAX_IDENTIFIER_BYTES} bytes")
    # GE hands queries to SQLAlchemy's text(), which reads `:word` as a bind parameter even
    # inside quotes; NUL cannot appear in a PostgreSQL name at all.
    if ":" in name or "\x00" in name:
        raise ConfigurationError(f"{what} {name!r} must not contain ':' or NUL")


def _check_names(names: tuple[str, ...] | list[str], what: str) -> None:
    for name in names:
        _check_name(name, what)


@dataclass(frozen=True)
class PostgresTableTarget:
    """A PostgreSQL sink table and the rules its rows must satisfy.

    Attributes:
        sink: The sink's name in the job and in `onceflow.sink_commits`.
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
        _check_names([self.schema, self.table], "table name")
        if not self.key:
            raise ConfigurationError(f"sink {self.sink!r}: key must name at least one column")
        _check_names((*self.key, *self.not_null, *self.regex, *self.row_filter), "column")
        for value in self.row_filter.values():
            if ":" in value or "\x00" in value:
                raise ConfigurationError(
                    f"sink {self.sink!r}: row_filter values must not hold ':' or NUL"
                )
        if self.expected_rows_from not in ("markers", "none"):
            raise ConfigurationError(
                f"sink {self.sink!r}: expected_rows_from must be 'markers' or 'none'"
            )


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
        _check_names(list(self.balances) + list(self.source), "table name")
        if not self.group_keys:
            raise ConfigurationError(
                f"sink {self.sink!r}: group_keys must name at least one column"
            )
        _check_names((*self.group_keys, self.total_col, self.count_col, self.amount_col), "column")


Target = PostgresTableTarget | DeltaTableTarget | SumConsistency


@dataclass(frozen=True)
class CheckSpec:
    """One check of a suite, independent of Great Expectations.

    Attributes:
        check: The check's name in results (`keys_unique`, `row_count`, `not_null:<col>`, …).
        kind: How the check is evaluated.
        description: What the check proves, in a sentence.
        observed_key: The name under which the check's main measured number is reported.
        query: For `unexpected_rows`: a query over `{batch}` that must return no row.
        column: For column checks: the column.
        value: For `row_count` and `value_equals`: the expected value.
        regex: For `regex`: the pattern.
    """

    check: str
    kind: CheckKind
    description: str
    observed_key: str
    query: str | None = None
    column: str | None = None
    value: int | None = None
    regex: str | None = None


@dataclass(frozen=True)
class SuiteSpec:
    """The checks run against one sink, named `<job>.<sink>` (plus a suffix for extra suites)."""

    name: str
    sink: str
    checks: tuple[CheckSpec, ...]


def _ge_query(query: sql.Composable) -> str:
    """Render a query for GE: braces doubled, `{batch}` left as GE's one placeholder."""
    text = query.as_string()
    return text.replace("{", "{{").replace("}", "}}").replace(_BATCH_SENTINEL, "{batch}")


def _columns(names: tuple[str, ...]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(name) for name in names)


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


def _column_checks(sink: str, not_null: tuple[str, ...], regex: dict[str, str]) -> list[CheckSpec]:
    checks = [
        CheckSpec(
            check=f"not_null:{column}",
            kind="not_null",
            description=f"{sink}: column {column} holds no NULL",
            observed_key="nulls",
            column=column,
        )
        for column in not_null
    ]
    checks += [
        CheckSpec(
            check=f"regex:{column}",
            kind="regex",
            description=f"{sink}: every value of {column} matches {pattern}",
            observed_key="mismatches",
            column=column,
            regex=pattern,
        )
        for column, pattern in regex.items()
    ]
    return checks


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
            query=_ge_query(
                duplicates.format(batch=sql.SQL(_BATCH_SENTINEL), keys=_columns(target.key))
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
    checks += _column_checks(target.sink, target.not_null, target.regex)
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
        keys=_columns(keys),
        total=sql.Identifier(target.total_col),
        count=sql.Identifier(target.count_col),
        batch=sql.SQL(_BATCH_SENTINEL),
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
        query=_ge_query(query),
    )
    return SuiteSpec(name=f"{job}.{target.sink}.sum_consistency", sink=target.sink, checks=(check,))


def balances_relation_query(target: SumConsistency) -> str:
    """Return the `SELECT` over the accumulated table (the GE query asset of its suite)."""
    return sql.SQL("SELECT * FROM {}").format(sql.Identifier(*target.balances)).as_string()


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
