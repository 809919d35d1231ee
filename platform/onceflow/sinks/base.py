"""The Sink protocol: a sink spec (job data) and the group that owns its whole commit protocol.

A job's sinks are specs (`DeltaSink`, `PostgresSink`). When a job runs, each kind opens its
specs as *groups*: the sinks a kind commits together. A Delta table is one group; all the
PostgreSQL sinks of a job live in one database and commit a window in one transaction, so a
reader never sees a window's payments without its balances. The engine, restatement, reconcile,
status, quality and the Dagster layer only call `SinkGroup` methods; the protocols (markers,
app transactions, fences, staging, repairs) live with each kind in its own package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from onceflow.sinks.contract import (
    CommitRecord,
    ReconcileScope,
    RecordedWindow,
    SinkOutcome,
    SinkReconcile,
    TableFacts,
    WindowWrite,
)
from onceflow.sinks.spec import SinkSpec
from onceflow.storage import Location

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import DataFrame, SparkSession

    from onceflow._ledger_scan import KnownWindows
    from onceflow.job import Job
    from onceflow.ledger import Ledger, Window
    from onceflow.quality.target import Target
    from onceflow.settings import Settings


@dataclass(frozen=True)
class SinkContext:
    """What a sink group needs to reach its storage and the job's ledger."""

    job: Job
    settings: Settings
    dsn: str
    ledger: Ledger


class SinkGroup(ABC):
    """Sinks of one kind that a window is committed to together, with their whole protocol."""

    kind: str
    specs: tuple[SinkSpec, ...]
    #: Its commit records name every window it committed for good (nothing cleans them up).
    keeps_window_records: ClassVar[bool] = False
    #: The fault point (`onceflow.faults`) right after it committed a window, before the next
    #: group: crash tests stop a run there.
    fault_after_commit: ClassVar[str]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @abstractmethod
    def prepare(self) -> None:
        """Create what the sinks need that does not depend on data (tables, marker DDL)."""

    def check_tables(self) -> None:
        """Before a run computes anything (after `prepare`): refuse tables that cannot take
        the declared rows (a declared column missing, renamed or of another type), naming the
        sink, the column and the command or migration that fixes it.

        Raises:
            SinkError: A table does not fit its sink's declaration.
        """
        return None

    @abstractmethod
    def epoch_floor(self) -> int:
        """The highest epoch these sinks have seen (so a new epoch is higher without a ledger)."""

    @abstractmethod
    def claim_epoch(self, epoch: int) -> None:
        """Record `epoch` so that commits of older runs fail from now on.

        Raises:
            FencedError: A newer epoch has claimed the sinks already.
        """

    @abstractmethod
    def held(self, window_ids: Sequence[int]) -> dict[str, set[int]]:
        """For each sink, which of `window_ids` it holds."""

    def pinned(self) -> AbstractContextManager[None]:
        """Within it, read-only checks may share one read of the sinks' state (start-up's
        rebuild, retention check and epoch floor); nothing is committed within it."""
        return nullcontext()

    def held_floor(self) -> int:
        """A window id through which every sink of the group holds every completed window
        the ledger expects of it, told without listing them: what `held` would say (a Delta
        table's app transaction), or the point a passed check verified while nothing since
        could have changed its answer (`record_held`). 0: ask about every window."""
        return 0

    def held_mark(self, through: int) -> Any:
        """Taken just before a check that the group's sinks hold every completed window
        through `through`, and handed to `record_held` once it passed (a group whose
        `held_floor` is the point its last passed check verified). None by default."""
        return None

    def record_held(self, through: int, mark: Any) -> None:
        """The check `mark` was taken for passed (`held_mark`). Nothing by default."""
        return None

    def state_problems(self) -> dict[str, str]:
        """For each sink not in the state the ledger expects, beyond windows it lacks (`held`
        tells those): what is wrong, e.g. restatements it lost. Empty when all is well."""
        return {}

    def prepare_replay(self) -> None:
        """Before windows a sink lacks are put back (reconcile, recovery): accept the sink's
        table as it stands as the one to make whole (a lost table may be created again)."""
        return None

    def end_replay(self) -> None:
        """After the windows a sink lacked were put back."""
        return None

    @abstractmethod
    def committed_through(self) -> dict[str, int]:
        """For each sink, the highest window id it holds (0 for none)."""

    @abstractmethod
    def recorded_windows(self, after: int = 0) -> list[RecordedWindow]:
        """Every window above `after` the sinks' commit records name, with its offsets and
        epoch (`after`: the ledger has every window through it, so older records are not
        read)."""

    def commit_records(self, window_ids: Sequence[int]) -> dict[str, dict[int, CommitRecord]]:
        """For each sink, its own record of the commit that wrote each of `window_ids` (those
        it holds and still has a record of), so a window an earlier run committed and a later
        run completed shows that commit in lineage. Empty for kinds that keep none."""
        return {}

    def unrecorded(self, known: KnownWindows) -> str | None:
        """Why the sinks' commit records may not name every window they hold that is not in
        `known` (None when they do): a ledger rebuilt from them would plan that input again."""
        return None

    def restated_through(self) -> int:
        """The highest restatement sequence number any of the sinks applied (0 for none), so a
        new restatement is numbered above it even if the ledger lost its restatements."""
        return 0

    @abstractmethod
    def begin(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        sinks: Sequence[str],
        *,
        epoch: int,
        run_id: str,
    ) -> WindowWrite:
        """Prepare committing `window` to `sinks` (names in this group): say what the executors
        write. Nothing is visible to readers until `finish`."""

    @abstractmethod
    def finish(
        self,
        window: Window,
        write: WindowWrite,
        results: Mapping[str, Sequence[Mapping[str, Any]]],
        outputs: Mapping[str, DataFrame],
        *,
        epoch: int,
        run_id: str,
        exactly_once: bool,
    ) -> dict[str, SinkOutcome]:
        """Commit what `write`'s writers wrote (`results`, by writer key), unless the sinks
        hold the window already; `outputs` can be written again if the staged copy was lost.

        Raises:
            FencedError: A newer run has taken over; nothing was written.
            SinkError: The commit failed; nothing was written.
        """

    @abstractmethod
    def check_restate(self, window: Window) -> None:
        """Raise SinkError if `window` cannot be restated here (checked before any change)."""

    def fold_records(self, conn: psycopg.Connection, through: int) -> int:
        """Fold the per-window commit records of windows through `through` into fewer rows
        that still answer every reader of them (which windows the sinks hold, what a rebuild
        puts back); return the records folded. Called by maintenance with `forget_detail`, in
        the same transaction. None by default (a Delta table's log is its own)."""
        return 0

    def forget_detail(self, conn: psycopg.Connection, through: int) -> int:
        """Drop the per-window records of windows through `through` that only restating them
        reads; return the rows dropped. Called by maintenance inside the ledger's transaction
        that holds the job's row (no commit runs meanwhile); `check_restate` refuses those
        windows afterwards where it needed them. None by default."""
        return 0

    @abstractmethod
    def restatement_applied(self, seq: int) -> set[str]:
        """The group's sinks that applied restatement `seq` (planned restatements are applied
        in sequence order, so an unfinished one is applied where this says so and nowhere
        else)."""

    @abstractmethod
    def restate(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        *,
        epoch: int,
        run_id: str,
        seq: int,
    ) -> dict[str, SinkOutcome]:
        """Replace the window's effect in every sink of the group (restatement `seq`, once)."""

    def seen_keys(
        self,
        spark: SparkSession,
        sink: str,
        keys: Sequence[str],
        *,
        before: int | None = None,
        only: Sequence[int] | None = None,
    ) -> DataFrame | None:
        """Keys of the sink's rows, with the first window holding each as `__seen_in`.

        Args:
            spark: The Spark session.
            sink: The sink's name.
            keys: The key columns.
            before: Only rows of windows before this one.
            only: Only rows of these windows.

        Returns:
            None when the sink holds no rows yet. Kinds with `holds_dedupe_state` implement it.
        """
        raise NotImplementedError(f"{self.kind} sinks cannot hold dedupe state")

    @abstractmethod
    def reconcile(
        self,
        spark: SparkSession,
        sink: str,
        expected: DataFrame | None,
        scope: ReconcileScope,
        *,
        epoch: int | None,
        run_id: str,
        workdir: Location,
    ) -> SinkReconcile:
        """Diff one sink with `expected` (rows plus `__onceflow_window`); repair if `epoch`."""

    def reconcile_since(self, sink: str, verified: int) -> int:
        """The window after which an incremental reconcile of a sink verified through
        `verified` needs the expected rows (`scope.since` is then this): `verified` when the
        sink's compare of the windows after it needs no earlier window's rows; 0 (every
        window recomputed) otherwise, the default."""
        return 0

    @abstractmethod
    def check_retention(
        self, oldest_window: datetime | None, *, records_elsewhere: bool = False
    ) -> None:
        """Raise ConfigurationError if the sinks may forget commit records recovery needs
        (`records_elsewhere`: another group keeps every window's record for good)."""

    @abstractmethod
    def data_version(self, sink: str) -> int | None:
        """A version of the sink's data for the UI (the Delta version), if the kind has one."""

    def table_facts(self, sink: str) -> TableFacts | None:
        """The sink's table as a catalog shows it (location, columns, rows now), if the kind
        can say."""
        return None

    @abstractmethod
    def quality_targets(self) -> list[Target]:
        """The quality suites of the group's sinks."""

    @abstractmethod
    def status(self) -> dict[str, dict[str, Any]]:
        """For each sink, plain facts for `onceflow status` (JSON-serialisable)."""


__all__ = [
    "CommitRecord",
    "ReconcileScope",
    "RecordedWindow",
    "SinkContext",
    "SinkGroup",
    "SinkOutcome",
    "SinkReconcile",
    "SinkSpec",
    "TableFacts",
    "WindowWrite",
]
