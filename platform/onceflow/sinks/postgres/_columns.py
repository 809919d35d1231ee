"""A PostgreSQL sink's table against the columns the job declares: what differs, and the SQL
that fixes it.

A table is made by the sink's first run (`CREATE TABLE IF NOT EXISTS`) and never altered by
onceflow: a column added to the job later, or renamed or retyped in the table by hand, would
otherwise surface as PostgreSQL refusing a window at commit, after the window was computed.
The problems are found from the catalog and from PostgreSQL's own analysis of an insert of the
declared types (`EXPLAIN`, so nothing runs and no trigger fires) into an empty temporary copy
of the table (`LIKE ... INCLUDING ALL`, rolled back): planning an insert into the table itself
would take its ROW EXCLUSIVE lock, and so wait behind any writer's lock on it. Messages name tables,
columns and types only: never a row's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from onceflow.sinks.postgres.spec import PostgresSink


@dataclass(frozen=True)
class TableColumn:
    """A column as the catalog shows it."""

    name: str
    type: str  # format_type(): `timestamp with time zone`, `character varying(20)`, …
    required: bool  # NOT NULL with no default (nor identity, nor generated)


# format_type() of each type a sink may declare.
_CATALOG_NAMES = {"timestamptz": "timestamp with time zone"}


def _catalog_name(declared: str) -> str:
    return _CATALOG_NAMES.get(declared, declared)


def _base(type_name: str) -> str:
    return type_name.split("(", 1)[0].strip()


def table_columns(conn: psycopg.Connection, spec: PostgresSink) -> dict[str, TableColumn] | None:
    """The sink's table's columns by name, in table order; None when there is no table."""
    regclass = sql.Identifier(spec.schema, spec.table).as_string(conn)
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod),"
        " a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '',"
        " c.oid IS NOT NULL"
        " FROM (SELECT to_regclass(%s) AS oid) c"
        " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
        " ORDER BY a.attnum",
        (regclass,),
    ).fetchall()
    if not rows or not rows[0][3]:
        return None
    return {str(n): TableColumn(str(n), str(t), bool(r)) for n, t, r, _ in rows if n is not None}


def table_problems(conn: psycopg.Connection, spec: PostgresSink) -> list[str]:
    """What keeps the sink's table from taking the declared rows, each with its fix; empty
    when it fits. `conn` is in autocommit or an open transaction it may use."""
    columns = table_columns(conn, spec)
    if columns is None:
        return []  # the table is created by `prepare`; a missing one is the sink state's matter
    target = sql.Identifier(spec.schema, spec.table).as_string(conn)  # in SQL
    table = f"{spec.schema}.{spec.table}"  # in prose

    def ident(name: str) -> str:
        return sql.Identifier(name).as_string(conn)

    problems: list[str] = []
    missing = [c for c in spec.columns if c not in columns]
    undeclared = [c for c in columns.values() if c.name not in spec.columns]
    for name in missing:
        declared = spec.columns[name]
        # A column the sink does not know, of the declared type, is likely the same renamed.
        alike = [c for c in undeclared if _base(c.type) == _catalog_name(declared)]
        renamed = (
            f"if it was renamed, `ALTER TABLE {target} RENAME COLUMN {ident(alike[0].name)} TO "
            f"{ident(name)}`; "
            if len(missing) == 1 and len(alike) == 1
            else ""
        )
        problems.append(
            f"sink {spec.name}: table {table} has no column {name} (declared {declared}): "
            f"{renamed}if it is new, `ALTER TABLE {target} ADD COLUMN {ident(name)} {declared}` "
            "(rows written before hold NULL in it until their windows are restated)"
        )
    for column in undeclared:
        if column.required:
            problems.append(
                f"sink {spec.name}: table {table} requires column {column.name} (NOT NULL, no "
                "default), which the sink does not declare: declare it in the sink's columns, "
                f"or `ALTER TABLE {target} ALTER COLUMN {ident(column.name)} DROP NOT NULL`"
            )
    present = {c: t for c, t in spec.columns.items() if c in columns}
    if not present and spec.mode != "upsert":
        return problems
    with conn.transaction(force_rollback=True):
        probe = _probe_copy(conn, spec)
        if present and not _insert_fits(conn, probe, present):
            # Which columns PostgreSQL cannot store the declared type in: each asked on its own.
            for name, declared in present.items():
                if not _insert_fits(conn, probe, {name: declared}):
                    actual = columns[name].type
                    problems.append(
                        f"sink {spec.name}: column {name} of table {table} is {actual}, which "
                        f"does not take the declared {declared}: `ALTER TABLE {target} ALTER "
                        f"COLUMN {ident(name)} TYPE {declared} USING {ident(name)}::{declared}`, "
                        "or declare a type the column takes"
                    )
        if spec.mode == "upsert" and not missing and not _upsert_fits(conn, probe, spec):
            keys = ", ".join(ident(k) for k in spec.key)
            problems.append(
                f"sink {spec.name}: an upsert needs a primary key or unique index on "
                f"({', '.join(spec.key)}) of table {table}: `ALTER TABLE {target} ADD PRIMARY "
                f"KEY ({keys})`"
            )
    return problems


def _probe_copy(conn: psycopg.Connection, spec: PostgresSink) -> sql.Identifier:
    """An empty temporary table like the sink's (types, defaults, constraints, unique indexes),
    dropped with the caller's transaction. Copying takes only ACCESS SHARE on the table."""
    name = f"onceflow_probe_{spec.table}"[:63]
    conn.execute(
        sql.SQL("CREATE TEMPORARY TABLE {} (LIKE {} INCLUDING ALL) ON COMMIT DROP").format(
            sql.Identifier(name), sql.Identifier(spec.schema, spec.table)
        )
    )
    return sql.Identifier("pg_temp", name)


def _explains(conn: psycopg.Connection, query: sql.Composable) -> bool:
    """Whether PostgreSQL accepts `query` (planned by EXPLAIN, never run)."""
    try:
        with conn.transaction():  # a savepoint: a refusal leaves the probe's transaction usable
            conn.execute(sql.SQL("EXPLAIN {}").format(query))
    except (
        psycopg.errors.DatatypeMismatch,  # a declared type the column cannot take
        psycopg.errors.InvalidColumnReference,  # no unique index for ON CONFLICT
        psycopg.errors.UndefinedColumn,
    ):
        return False
    except psycopg.OperationalError:
        raise  # a lost connection: the caller's retry decides
    except psycopg.Error:
        return True  # not a matter of columns: the commit reports it if it persists
    return True


def _typed_nulls(columns: dict[str, str]) -> tuple[sql.Composable, sql.Composable]:
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    values = sql.SQL(", ").join(
        sql.SQL("NULL::{}").format(sql.SQL(pg_type)) for pg_type in columns.values()
    )
    return names, values


def _insert_fits(conn: psycopg.Connection, probe: sql.Identifier, columns: dict[str, str]) -> bool:
    names, values = _typed_nulls(columns)
    return _explains(
        conn, sql.SQL("INSERT INTO {} ({}) SELECT {} WHERE false").format(probe, names, values)
    )


def _upsert_fits(conn: psycopg.Connection, probe: sql.Identifier, spec: PostgresSink) -> bool:
    key = {k: spec.columns[k] for k in spec.key}
    names, values = _typed_nulls(key)
    return _explains(
        conn,
        sql.SQL("INSERT INTO {} ({}) SELECT {} WHERE false ON CONFLICT ({}) DO NOTHING").format(
            probe,
            names,
            values,
            sql.SQL(", ").join(sql.Identifier(k) for k in spec.key),
        ),
    )


# Tables with more rows than this get the planner's row estimate in catalogs, not a count.
ESTIMATE_ROWS_ABOVE = 1_000_000


def count_rows(conn: psycopg.Connection, spec: PostgresSink, job: str) -> tuple[int, bool] | None:
    """The rows the sink's table holds (for a shared table, `job`'s) and whether that is the
    planner's estimate; None when the table does not exist."""
    count = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(spec.schema, spec.table))
    params: tuple[Any, ...] = ()
    if spec.job_column is not None:  # a shared table: this job's rows
        count = sql.SQL("{} WHERE {} = %s").format(count, sql.Identifier(spec.job_column))
        params = (job,)
    found = conn.execute(
        "SELECT c.reltuples FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
        (spec.schema, spec.table),
    ).fetchone()
    if found is None:
        return None
    # Counting reads the whole table, on every run: past ESTIMATE_ROWS_ABOVE rows the
    # planner's estimate stands in (a shared table has none per job).
    if spec.job_column is None and found[0] >= ESTIMATE_ROWS_ABOVE:
        return int(found[0]), True
    row = conn.execute(count, params).fetchone()
    return (int(row[0]), False) if row else None


def create_table(conn: Any, spec: PostgresSink) -> None:
    columns = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(name),
            sql.SQL(pg_type),
            sql.SQL(" NOT NULL") if name in spec.key or name in spec.accumulate else sql.SQL(""),
        )
        for name, pg_type in spec.columns.items()
    ]
    if spec.key:
        columns.append(
            sql.SQL("PRIMARY KEY ({})").format(
                sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
            )
        )
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(spec.schema)))
    conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            sql.Identifier(spec.schema, spec.table), sql.SQL(", ").join(columns)
        )
    )
