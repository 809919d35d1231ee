"""`PostgresSink`: a job's output in a PostgreSQL table, and the column types it may declare."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from onceflow._identifiers import check_identifier
from onceflow.errors import ConfigurationError
from onceflow.job import QUARANTINE_FIELDS
from onceflow.sinks.base import SinkSpec

if TYPE_CHECKING:
    import pyarrow as pa

# PostgreSQL column types a sink may declare, with their Spark and Arrow counterparts.
SPARK_TYPES: dict[str, str] = {
    "text": "STRING",
    "bigint": "BIGINT",
    "integer": "INT",
    "double precision": "DOUBLE",
    "numeric": "DECIMAL(38,18)",
    "timestamptz": "TIMESTAMP",
    "boolean": "BOOLEAN",
    "date": "DATE",
}
PG_TYPES = frozenset(SPARK_TYPES)
MODES = ("append", "upsert", "accumulate")
# A typed source's column types (`onceflow.sources._typed`) as the sink column types they map to,
# so a column is typed in one vocabulary: `decimal(p,s)` is stored as numeric.
_FROM_SOURCE_TYPES: dict[str, str] = {
    "string": "text",
    "bigint": "bigint",
    "int": "integer",
    "double": "double precision",
    "boolean": "boolean",
    "date": "date",
    "timestamp": "timestamptz",
    "decimal": "numeric",
}


def sink_type(declared: str, where: str) -> str:
    """The PostgreSQL type of a declared column type: one of `PG_TYPES`, or a typed source's
    type (`string`, `int`, `double`, `timestamp`, `decimal(p,s)`, …), mapped.

    Raises:
        ConfigurationError: Neither vocabulary knows it.
    """
    from onceflow.sources._typed import parse_type

    if isinstance(declared, str):
        norm = " ".join(declared.strip().lower().split())
        if norm in PG_TYPES:
            return norm
        try:
            return _FROM_SOURCE_TYPES[parse_type(norm, where).kind]
        except ConfigurationError:
            pass
    raise ConfigurationError(
        f"{where} has type {declared!r}; use one of {sorted(PG_TYPES)}, or a source type "
        "(string, bigint, int, double, boolean, date, timestamp, decimal(p,s))."
    )


def _column_pairs(columns: Any, sink: str) -> list[tuple[str, str | None]]:
    """`columns` as (name, type or None) pairs: a mapping, or a sequence of names and
    (name, type) pairs; None: the type is the source column's."""
    if isinstance(columns, Mapping):
        return list(columns.items())
    if isinstance(columns, (list, tuple)):
        pairs: list[tuple[str, str | None]] = []
        for item in columns:
            if isinstance(item, str):
                pairs.append((item, None))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append((item[0], item[1]))
            else:
                break
        else:
            return pairs
    raise ConfigurationError(
        f"sink {sink}: columns must map names to types ({{'id': 'text'}}), or list names (typed "
        "as the source's columns) and (name, type) pairs."
    )


def arrow_type(pg_type: str) -> pa.DataType:
    """The Arrow type a column of `pg_type` is read as."""
    import pyarrow as pa

    return {
        "text": pa.string(),
        "bigint": pa.int64(),
        "integer": pa.int32(),
        "double precision": pa.float64(),
        "numeric": pa.decimal128(38, 18),
        "timestamptz": pa.timestamp("us", tz="UTC"),
        "boolean": pa.bool_(),
        "date": pa.date32(),
    }[pg_type]


def spark_schema(columns: Mapping[str, str]) -> str:
    """The Spark DDL schema of a PostgreSQL sink's columns."""
    return ", ".join(f"`{name}` {SPARK_TYPES[pg]}" for name, pg in columns.items())


@dataclass(frozen=True)
class PostgresSink(SinkSpec):
    """A PostgreSQL table written in one transaction per window with a commit marker.

    All the PostgreSQL sinks of a job commit a window in one transaction.

    Attributes:
        name: The sink's name.
        output: The transform output it receives.
        table: The table's name.
        columns: Column name → type, in table order: a PostgreSQL type (one of `PG_TYPES`) or
            a typed source's (`string` is text, `timestamp` timestamptz, `decimal(p,s)`
            numeric, …). A column given without a type (a name in a list, or None in a
            mapping) has its source column's type, filled in when the job loads.
        key: The primary key; needed by `upsert` and `accumulate`.
        mode: `append` (insert), `upsert` (insert or replace by `key`), `accumulate` (add the
            `accumulate` columns into the row with the same key; a row whose accumulated
            columns all come back to zero is deleted).
        schema: The table's schema.
        accumulate: The columns `accumulate` adds up (summed exactly, as numeric).
        window_column: A column holding each row's window id; lets a restatement and an
            incremental reconcile find a window's rows.
        job_column: A column holding the job's name, for a table several jobs share (the
            quarantine): every read, delete and check of this job filters on it.
        order_by: For `upsert`: the column that decides which row of a key the table keeps,
            the one with the greatest value (a null is the least), within a window and across
            windows alike; a tie goes to the later position (window, then the output's
            `_file_idx`, then `_source_line`). Without it, a window gives one row per key and
            the later window's row wins.
    """

    table: str
    columns: Mapping[str, str]
    key: tuple[str, ...] = ()
    mode: str = "append"
    schema: str = "public"
    accumulate: tuple[str, ...] = ()
    window_column: str | None = None
    job_column: str | None = None
    order_by: str | None = None

    kind: ClassVar[str] = "postgres"

    def __post_init__(self) -> None:
        super().__post_init__()
        columns: dict[str, str | None] = {}
        for column, declared in _column_pairs(self.columns, self.name):
            check_identifier(column, f"sink {self.name}: column")
            where = f"sink {self.name}: column {column}"
            columns[column] = None if declared is None else sink_type(declared, where)
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "key", tuple(self.key))
        object.__setattr__(self, "accumulate", tuple(self.accumulate))
        check_identifier(self.schema, f"sink {self.name}: schema")
        check_identifier(self.table, f"sink {self.name}: table")
        if not self.columns:
            raise ConfigurationError(f"sink {self.name}: declare its columns.")
        if self.mode not in MODES:
            raise ConfigurationError(
                f"sink {self.name}: mode {self.mode!r} is unknown; use append, upsert or accumulate."
            )
        if self.mode in ("upsert", "accumulate") and not self.key:
            raise ConfigurationError(f"sink {self.name}: mode {self.mode} needs a key.")
        if self.mode == "accumulate" and not self.accumulate:
            raise ConfigurationError(f"sink {self.name}: mode accumulate needs accumulate columns.")
        if self.accumulate and self.mode != "accumulate":
            raise ConfigurationError(
                f"sink {self.name}: accumulate columns are only for mode accumulate."
            )
        named = [*self.key, *self.accumulate]
        named += [c for c in (self.window_column, self.job_column, self.order_by) if c is not None]
        missing = [c for c in named if c not in self.columns]
        if missing:
            raise ConfigurationError(
                f"sink {self.name}: columns {missing} are named as key, accumulate, window, "
                "job or order_by column but are not in `columns`."
            )
        if self.order_by is not None and self.mode != "upsert":
            raise ConfigurationError(
                f"sink {self.name}: order_by is for mode upsert (it picks the row a key keeps)."
            )
        if self.order_by is not None and self.order_by in self.key:
            raise ConfigurationError(
                f"sink {self.name}: order_by {self.order_by!r} is a key column; name the column "
                "whose greatest value should win (an `updated_at`)."
            )
        overlap = set(self.key) & set(self.accumulate)
        if overlap:
            raise ConfigurationError(
                f"sink {self.name}: {sorted(overlap)} cannot be both key and accumulate columns."
            )

    def describe(self) -> str:
        return f"PostgreSQL table `{self.schema}.{self.table}` ({self.mode})"

    @property
    def table_name(self) -> str:
        return f"{self.schema}.{self.table}"

    def declared_columns(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.columns.items())

    @property
    def untyped_columns(self) -> list[str]:
        """Columns declared without a type (to take their source column's)."""
        return [c for c, t in self.columns.items() if t is None]

    @property
    def is_quarantine_table(self) -> bool:
        return (self.schema, self.table) == QUARANTINE_TABLE

    def typed(self, types: Mapping[str, str]) -> PostgresSink:
        """This sink with the types of its untyped columns from `types` (source types)."""
        columns = {
            c: t if t is not None else sink_type(types[c], f"sink {self.name}: column {c}")
            for c, t in self.columns.items()
        }
        return replace(self, columns=columns)


# The table `quarantine_table()` writes, shared by every job.
QUARANTINE_TABLE = ("onceflow", "quarantine")
QUARANTINE_COLUMNS: dict[str, str] = dict(
    zip(QUARANTINE_FIELDS, ("text", "bigint", "text", "bigint", "text", "text"), strict=True)
)


def quarantine_table(name: str = "pg_quarantine", *, output: str = "quarantine") -> PostgresSink:
    """The standard quarantine sink: `onceflow.quarantine`, shared by jobs, one row per invalid
    record keyed by its source position (so a replay never doubles it).

    Give its name as the job's `quarantine_sink`.
    """
    return PostgresSink(
        name=name,
        output=output,
        schema="onceflow",
        table="quarantine",
        columns=QUARANTINE_COLUMNS,
        key=("job", "source_file", "source_line"),
        mode="upsert",
        window_column="window_id",
        job_column="job",
    )
