"""The Source protocol: what planning, reading, replay checks, lag and new-data triggers need.

A source is replayable and deterministic: the same offsets always give the same records in the
same order. Its input comes in *units* (a landing file, a Delta table version): strings that
sort in source order, that the ledger indexes so each unit is planned into exactly one window,
and that a window's offsets list exactly.

Every frame a source reads carries the position of each record in three columns, so quarantine
rows, deduplication ("first occurrence in source order") and replays agree on it:

- `_file_idx INT`: the index of the record's unit (file, Delta data file) within the window;
- `_source_file STRING`: the unit's name (a path relative to the landing root, or
  `v<version>/<data file>` for a Delta table);
- `_source_line BIGINT`: the record's 1-based position within it.

A source whose records are typed (CSV with a schema, Parquet, Delta) also gives `_reason`
(null for a valid record) and `_raw_text` (the record as text, for the quarantine), so a job
needs no parse step; a raw source (JSON lines) gives `_raw BINARY` and the job parses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.settings import Settings

POSITION_COLUMNS: tuple[str, ...] = ("_file_idx", "_source_file", "_source_line")
REASON_COLUMN = "_reason"
RAW_TEXT_COLUMN = "_raw_text"


# A function over one partition's Arrow batches, as `DataFrame.mapInArrow` takes it.
BatchFunction = Callable[[Iterator["pa.RecordBatch"]], Iterator["pa.RecordBatch"]]


@dataclass(frozen=True)
class ArrowParse:
    """A parse step over Arrow batches: `fn` turns raw batches into batches of `schema`.

    Use it as a job's `parse` when the parse is Python code over each partition's batches. It
    works on any raw source; a source that reads in Python itself (landing files) runs it in
    that same step, which saves a pass of every record through a Python worker.

    Attributes:
        fn: The function, as `DataFrame.mapInArrow` takes it.
        schema: Its output schema, as a DDL string.
        keeps_order: `fn` yields its rows in the order of the lines they come from (and keeps
            `_file_idx` and `_source_line`). A window read in order in one partition is then
            deduplicated on the way, with no sort; a row out of order fails the window.
    """

    fn: BatchFunction
    schema: str
    keeps_order: bool = False

    def __call__(self, raw: DataFrame) -> DataFrame:
        return raw.mapInArrow(self.fn, self.schema)


@dataclass(frozen=True)
class ChangedUnit:
    """A unit of a committed window that is no longer what the window recorded.

    Attributes:
        window_id: The window that committed the unit.
        unit: The unit (a path relative to the landing root).
        detail: What differs (sizes, modification times; never contents).
    """

    window_id: int
    unit: str
    detail: str

    def describe(self) -> str:
        return f"{self.unit} (window {self.window_id}): {self.detail}"


@dataclass(frozen=True)
class Observation:
    """What a source holds now, for triggers and the UI.

    Attributes:
        version: An opaque token that changes whenever new input appears (the newest file, the
            table version); equal tokens mean nothing new.
        units: How many units are visible.
        metadata: A few plain values for the UI (counts, names; never record contents).
    """

    version: str
    units: int
    metadata: Mapping[str, Any] = field(default_factory=dict)


class Source(ABC):
    """A replayable input of a job. Subclasses are frozen dataclasses (they are job data)."""

    #: A short name of the source's kind (`landing`, `delta`), for status and the UI.
    kind: str = "source"
    #: The raw frame holds `_reason` and `_raw_text` already: the job needs no parse step.
    typed: bool = False

    @abstractmethod
    def describe(self) -> str:
        """One line saying where the input comes from, for docs, status and the UI."""

    @property
    def lake_table(self) -> str | None:
        """The table under the lake root this source reads, if any: a job whose sink writes
        that table is upstream of this one."""
        return None

    def location(self, settings: Settings) -> str | None:
        """Where the input is, absolute (a folder or a URI), for status and messages."""
        table = self.lake_table
        return None if table is None else (settings.lake / table).uri

    def check_input(self, settings: Settings) -> None:
        """At the start of a run: fail when the input's location cannot hold input at all (a
        folder that does not exist). Input that is merely absent is fine.

        Raises:
            ConfigurationError: The location is missing; the message names it and its setting.
        """
        return None

    def changed_after_commit(
        self, settings: Settings, windows: Mapping[int, Mapping[str, Any]]
    ) -> list[ChangedUnit]:
        """Units of the given committed windows (id → offsets) that are still visible but
        differ from what the offsets recorded: input the job will never read again. Units
        that are gone are not listed (producers may clean up committed input)."""
        return []

    @abstractmethod
    def discover(self, settings: Settings, after: Mapping[str, Any] | None) -> list[str]:
        """Units visible now, in source order.

        Args:
            settings: Where the landing folder and the lake are.
            after: The offsets of the job's last planned window (None before the first): a
                hint that lets a source skip units it knows to be planned. The ledger still
                drops every unit it has already planned.
        """

    @abstractmethod
    def offsets(self, settings: Settings, units: Sequence[str]) -> dict[str, Any]:
        """The JSON offsets of a window made of `units` (given in source order)."""

    @abstractmethod
    def units(self, offsets: Mapping[str, Any]) -> list[str]:
        """The units a window's offsets cover, in source order."""

    @abstractmethod
    def check_available(self, settings: Settings, offsets: Mapping[str, Any]) -> list[str]:
        """What keeps a window from being read exactly as planned (empty when it can be)."""

    def rebased(self, settings: Settings, offsets: Mapping[str, Any]) -> dict[str, Any] | None:
        """The window's offsets for its input as it is now, when the source can tell that the
        input it recorded was replaced under the same units (a Delta table recreated, or
        restored from an older copy, renumbers its versions) and can read the replacement;
        None when the input is as recorded, or the source cannot tell.

        Raises:
            SourceError: The replacement cannot be read for these units (yet).
        """
        return None

    @abstractmethod
    def read(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> DataFrame:
        """The window's records with the position columns, read on the executors.

        Raises:
            SourceError: When the input is no longer what was planned.
        """

    @abstractmethod
    def observe(self, settings: Settings) -> Observation:
        """What the source holds now (cheap: no Spark)."""

    def read_mapped(
        self,
        spark: SparkSession,
        settings: Settings,
        offsets: Mapping[str, Any],
        fn: BatchFunction,
        schema: str,
    ) -> DataFrame:
        """The window's records passed through `fn` (output `schema`, a DDL string); a source
        that reads in Python runs `fn` in that same step.

        Raises:
            SourceError: When the input is no longer what was planned.
        """
        return self.read(spark, settings, offsets).mapInArrow(fn, schema)

    def window_read(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """What `read_planned` needs of this window (JSON-able), if it can read the window;
        None: it cannot, and the window is read with `read_mapped`.

        Raises:
            SourceError: When the input is no longer what was planned.
        """
        return None

    def read_planned(
        self, spark: SparkSession, settings: Settings, fn: BatchFunction, schema: str, slot: int
    ) -> DataFrame:
        """`read_mapped` planned once for any window: the step reads the window its task is
        given (`window_read`'s answer, under "read" in `_window_params.current()`), in one
        partition and in source order. `slot` tells apart plans in use at the same time."""
        raise NotImplementedError(f"{type(self).__name__} has no read planned once")

    def reads_in_order(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> bool:
        """Whether `read_mapped` passes the window's records to `fn` in one partition, in source
        order (`_file_idx`, then `_source_line`): the key lookup then finds a key's repeats
        within the window on the way, and the compute sorts nothing. False unless the source
        knows it."""
        return False

    def reads_in_runs(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> bool:
        """Whether each task of `read_mapped` passes `fn` its share of the window's records
        in source order (`_file_idx`, then `_source_line`; `reads_in_order` is the case of one
        task). The key lookup then finds a key's repeats within each task's share on the way,
        and the compute compares across tasks only the keys several of them kept, in place of
        sorting the window. False unless the source knows it."""
        return False

    def read_many(
        self, spark: SparkSession, settings: Settings, offsets: Sequence[Mapping[str, Any]]
    ) -> tuple[DataFrame, list[tuple[int, int, int]]] | None:
        """Several windows' records in one read, if the source can do that cheaply.

        Returns the frame, whose `_file_idx` numbers units across all the windows, and the
        map `(that index, position of the window in offsets, index within the window)`; or
        None, and the windows are read one by one.
        """
        return None

    def unit_age_s(self, settings: Settings, unit: str) -> float | None:
        """Seconds since `unit` appeared, when the source knows it (for lag)."""
        return None

    def unit_size(self, settings: Settings, unit: str) -> int | None:
        """Bytes in `unit`, when the source knows it (for lag)."""
        return None
