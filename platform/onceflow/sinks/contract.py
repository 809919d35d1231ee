"""What a sink group hands back to the rest of the platform: plain data, no kind's fields.

A leaf module: the engine, the ledger, lineage, reconcile and the operations read these types
without importing the sink protocol (`onceflow.sinks.base`) or any kind's package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow.sinks.writers import PartitionWriter

if TYPE_CHECKING:
    from onceflow._diff import Diff, DiffSample


@dataclass(frozen=True)
class SinkOutcome:
    """What one sink did with one window (or one restatement of it)."""

    sink: str
    committed: bool  # this run wrote the window
    already_committed: bool  # the sink held it before
    rows: int = 0
    # The version of the sink's data holding the window (a Delta table version), if the kind
    # versions its data, and the id of the commit that wrote it (a PostgreSQL transaction id),
    # if the kind has one: what lineage shows, whatever the kind.
    data_version: int | None = None
    commit_ref: str | None = None
    latency_s: float = 0.0


@dataclass(frozen=True)
class CommitRecord:
    """A sink's own record of the commit that wrote a window (for lineage, when an earlier
    run made that commit): the fields of `SinkOutcome` the record keeps, None where it does
    not (`rows`: None when the record does not count the rows that commit wrote)."""

    data_version: int | None = None
    commit_ref: str | None = None
    rows: int | None = None


@dataclass(frozen=True)
class TableFacts:
    """What a data catalog shows of one sink's table, never credentials.

    Attributes:
        uri: Where the table is: a Delta table's location, `postgresql://host/db/schema.table`.
        columns: (name, type) of its columns, in table order (empty before it exists).
        row_count: Rows it holds now (for a shared table, this job's rows); None if unknown.
        row_count_estimated: `row_count` is the database's estimate, not a count (large
            tables, where counting would read the whole table on every run).
    """

    uri: str
    columns: tuple[tuple[str, str], ...]
    row_count: int | None
    row_count_estimated: bool = False


@dataclass
class WindowWrite:
    """A group's part of one window's write, between `SinkGroup.begin` and `SinkGroup.finish`.

    Attributes:
        sinks: The group's sinks this write commits the window to.
        writers: What the executors write for them (staged, invisible until `finish` commits).
        state: The group's own bookkeeping (staging table names, …).
    """

    sinks: list[str]
    writers: list[PartitionWriter] = field(default_factory=list)
    state: Any = None


@dataclass(frozen=True)
class RecordedWindow:
    """A window as a sink's own commit record tells it (to rebuild a lost ledger)."""

    window_id: int
    offsets: dict[str, Any]
    epoch: int


@dataclass(frozen=True)
class ReconcileScope:
    """Which windows a reconcile compares in one sink.

    Attributes:
        unverifiable: Windows whose input is gone: their rows are left alone.
        since: Rows of windows up to this one were verified before (incremental mode).
        windows: Every window the ledger has planned.
    """

    unverifiable: frozenset[int]
    since: int
    windows: tuple[int, ...]


@dataclass(frozen=True)
class SinkReconcile:
    """What a reconcile found (and repaired) in one sink."""

    diff: Diff | None
    skipped: str | None  # why the sink was not compared
    committed: frozenset[int]  # windows the sink holds
    compared: frozenset[int]  # windows whose rows were compared one by one
    samples: tuple[DiffSample, ...] = ()  # the first differences, by key only
