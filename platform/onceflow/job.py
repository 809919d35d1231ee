"""Job definitions: a source, a parse step, a transform, sinks, a guarantee."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow._identifiers import check_identifier
from onceflow.errors import ConfigurationError
from onceflow.sources.landing import LandingSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class Guarantee(str, enum.Enum):
    """What a job promises about each record's effect on its sinks."""

    EXACTLY_ONCE = "exactly_once"  # markers, app transactions, epoch fences, replay
    AT_LEAST_ONCE = "at_least_once"  # replay after a crash, but no commit records: may double
    NONE = "none"  # no write-ahead plan: a crash may lose or double a window


@dataclass(frozen=True)
class WindowContext:
    """What a transform may know about the window it runs on."""

    job: str
    window_id: int


@dataclass(frozen=True)
class Dedupe:
    """Keep the first occurrence of each key in source order, across all windows.

    Keys seen in earlier windows are read from `state_sink` (a Delta sink holding every kept
    row with `_window_id`), restricted to windows before the current one, so a window replayed
    after a partial commit is deduplicated exactly as the first time.
    """

    key: tuple[str, ...]
    state_sink: str


@dataclass(frozen=True)
class DeltaSink:
    """A Delta table at `<lake>/<table>`, appended once per window."""

    name: str
    output: str
    table: str

    kind = "delta"


# PostgreSQL column types a sink may declare; each maps to fixed SQL text.
PG_TYPES = frozenset(
    {"text", "bigint", "integer", "double precision", "numeric", "timestamptz", "boolean", "date"}
)


@dataclass(frozen=True)
class PostgresSink:
    """A PostgreSQL table written in one transaction per window with a commit marker.

    Modes: `append` (insert), `upsert` (insert or replace by `key`), `accumulate` (add the
    `accumulate` columns into the existing row with the same key).
    """

    name: str
    output: str
    table: str
    columns: Mapping[str, str]
    key: tuple[str, ...] = ()
    mode: str = "append"
    schema: str = "public"
    accumulate: tuple[str, ...] = ()
    window_column: str | None = None  # lets a restatement find a window's rows

    kind = "postgres"

    def __post_init__(self) -> None:
        check_identifier(self.schema, f"sink {self.name}: schema")
        check_identifier(self.table, f"sink {self.name}: table")
        for column, pg_type in self.columns.items():
            check_identifier(column, f"sink {self.name}: column")
            if pg_type not in PG_TYPES:
                raise ConfigurationError(
                    f"sink {self.name}: column {column} has type {pg_type!r}; use one of "
                    f"{sorted(PG_TYPES)}."
                )
        if self.mode not in ("append", "upsert", "accumulate"):
            raise ConfigurationError(
                f"sink {self.name}: mode {self.mode!r} is unknown; use append, upsert or accumulate."
            )
        if self.mode in ("upsert", "accumulate") and not self.key:
            raise ConfigurationError(f"sink {self.name}: mode {self.mode} needs a key.")
        missing = [c for c in (*self.key, *self.accumulate) if c not in self.columns]
        if missing:
            raise ConfigurationError(
                f"sink {self.name}: key/accumulate columns {missing} not in columns."
            )
        if self.window_column is not None and self.window_column not in self.columns:
            raise ConfigurationError(
                f"sink {self.name}: window column {self.window_column} not in columns."
            )
        if self.mode == "accumulate" and not self.accumulate:
            raise ConfigurationError(f"sink {self.name}: mode accumulate needs accumulate columns.")


Sink = DeltaSink | PostgresSink

ParseFn = Callable[["DataFrame"], "DataFrame"]
TransformFn = Callable[["DataFrame", WindowContext], Mapping[str, "DataFrame"]]

QUARANTINE_OUTPUT = "quarantine"


@dataclass(frozen=True)
class Job:
    """A job: what to read, how to parse and transform it, and where its results go.

    Attributes:
        name: The job's name (an identifier; it keys the ledger, markers and app ids).
        source: Where the input comes from.
        parse: Raw lines → typed rows plus a `_reason` column, null for valid rows. Rows whose
            `_reason` is set go to the quarantine with their raw text.
        transform: Valid (deduplicated) rows → named outputs; pure, no side effects.
        sinks: Where each output goes; every sink commits each window exactly once.
        dedupe: Optional first-occurrence deduplication across windows.
        quarantine_sink: Name of the sink for the `quarantine` output.
        guarantee: The delivery guarantee.
        deterministic: False when the transform is not a pure function of its input; the
            window's outputs are then always served from the staged copy.
    """

    name: str
    source: LandingSource
    parse: ParseFn
    transform: TransformFn
    sinks: tuple[Sink, ...]
    dedupe: Dedupe | None = None
    quarantine_sink: str | None = None
    guarantee: Guarantee = Guarantee.EXACTLY_ONCE
    deterministic: bool = True
    description: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_identifier(self.name, "job name")
        names = [s.name for s in self.sinks]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"job {self.name}: sink names must be unique, got {names}.")
        for sink in self.sinks:
            check_identifier(sink.name, f"job {self.name}: sink name")
        if self.dedupe is not None:
            state = self.sink(self.dedupe.state_sink)
            if not isinstance(state, DeltaSink):
                raise ConfigurationError(
                    f"job {self.name}: dedupe state sink {self.dedupe.state_sink} must be a Delta sink."
                )
        if self.quarantine_sink is not None:
            self.sink(self.quarantine_sink)

    def sink(self, name: str) -> Sink:
        for sink in self.sinks:
            if sink.name == name:
                return sink
        raise ConfigurationError(
            f"job {self.name}: no sink named {name!r}; sinks are {[s.name for s in self.sinks]}."
        )

    def with_guarantee(self, guarantee: Guarantee | str) -> Job:
        from dataclasses import replace

        return replace(self, guarantee=Guarantee(guarantee))
