"""The checks a quality target expands into (independent of Great Expectations) and the
helpers each kind's targets build their suites with."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from psycopg import sql

from onceflow.errors import ConfigurationError

# PostgreSQL truncates longer names silently, so two long names could meet in one table.
_MAX_IDENTIFIER_BYTES = 63

# GE fills `{batch}` with str.format, so every other brace in a query must be doubled; the
# sentinel marks where `{batch}` goes while psycopg renders the rest.
BATCH_SENTINEL = f"onceflow_batch_{uuid.uuid4().hex}"

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


def check_names(names: tuple[str, ...] | list[str], what: str) -> None:
    for name in names:
        _check_name(name, what)


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


def ge_query(query: sql.Composable) -> str:
    """Render a query for GE: braces doubled, `{batch}` left as GE's one placeholder."""
    text = query.as_string()
    return text.replace("{", "{{").replace("}", "}}").replace(BATCH_SENTINEL, "{batch}")


def columns_sql(names: tuple[str, ...]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(name) for name in names)


def column_checks(sink: str, not_null: tuple[str, ...], regex: dict[str, str]) -> list[CheckSpec]:
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
