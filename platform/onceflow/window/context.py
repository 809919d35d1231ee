"""One job opened against its ledger, sink groups and key index: what every stage of a window
reads, and the start-up of every writing run."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from onceflow import _ledger_verified as ledger_verified
from onceflow._keyindex import KeyIndex
from onceflow._ledger_check import check_ledger
from onceflow._ledger_scan import contiguous_through, known_windows, unindexed_windows
from onceflow._staging import WindowStage
from onceflow.errors import ConfigurationError, LedgerError
from onceflow.job import Guarantee, Job
from onceflow.ledger import Ledger, Window
from onceflow.settings import Settings
from onceflow.sinks.base import SinkContext, SinkGroup
from onceflow.sinks.registry import open_groups

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow._ledger_verified import Verified
    from onceflow.sinks.writers import WritersPlan
    from onceflow.window.outputs import WindowOutputs

_log = logging.getLogger(__name__)


class Plans:
    """A run's windows planned once, for any window, in two slots (one window prepared while
    the one before it commits)."""

    def __init__(self) -> None:
        # By slot, the outputs; None once a plan was found not to hold for any window (the
        # job's windows are then planned one by one).
        self.outputs: dict[int, WindowOutputs] | None = {}
        # Slots are numbered from a base of their own, so no two engines' plans are equal
        # (Spark's cache matches equal plans across a session).
        self.slot_base = secrets.randbits(48) * 2
        # By slot, the writers' step of its last window, for the next window of the slot.
        self.writes: dict[int, WritersPlan] = {}

    def forget(self) -> None:
        """Drop the windows' plans and their cache entries (the next windows plan anew)."""
        if self.outputs:
            for out in self.outputs.values():
                if out.computed is not None:
                    out.computed.forget()
            self.outputs = {}
        self.writes.clear()


class JobContext:
    """One job against one set of settings, on one Spark session (or none, for status)."""

    def __init__(
        self,
        job: Job,
        settings: Settings,
        spark: SparkSession | None,
        dsn: str,
        *,
        guarantee: Guarantee | str | None = None,
    ) -> None:
        self.job = job.with_guarantee(guarantee) if guarantee else job
        self.settings = settings
        self._spark = spark
        self.dsn = dsn
        self.ledger = Ledger(dsn, job.name)
        self.groups: list[SinkGroup] = open_groups(
            self.job.sinks, SinkContext(self.job, settings, dsn, self.ledger)
        )
        self.group_of = {name: group for group in self.groups for name in group.names}
        self.index = KeyIndex(dsn, job.name, self.ledger) if job.dedupe is not None else None
        self.plans = Plans()
        self._prepared = False
        # The ledger's removal notes the last start-up read (`ledger_changed`).
        self._notes: ledger_verified.Notes | None = None

    @property
    def spark(self) -> SparkSession:
        """The Spark session; an engine opened for status only has none."""
        if self._spark is None:
            raise ConfigurationError(
                f"job {self.job.name}: this engine was opened without Spark (status only)."
            )
        return self._spark

    @property
    def spark_or_none(self) -> SparkSession | None:
        return self._spark

    @property
    def exactly_once(self) -> bool:
        return self.job.guarantee is Guarantee.EXACTLY_ONCE

    @property
    def sink_names(self) -> list[str]:
        return [s.name for s in self.job.sinks]

    @property
    def tracks_basis(self) -> bool:
        """Whether a window's outputs name what its dedupe saw (a job deduplicated by the key
        index, unless windows are marked completed when planned)."""
        return self.index is not None and self.job.guarantee is not Guarantee.NONE

    def held(self, window_ids: Sequence[int]) -> dict[int, set[str]]:
        """For each window, the sinks that hold it (one look per group)."""
        state: dict[int, set[str]] = {wid: set() for wid in window_ids}
        if not state:  # nothing to ask: no group loads its table for it
            return state
        for group in self.groups:
            for sink, ids in group.held(window_ids).items():
                for wid in ids:
                    state[wid].add(sink)
        return state

    def held_floor(self) -> int:
        """A window id through which every sink holds every window the ledger expects of it
        (`SinkGroup.held_floor`): the checks of what the sinks hold look only above it."""
        return min((group.held_floor() for group in self.groups), default=0)

    def committed_sinks(self, window_id: int) -> set[str]:
        """The sinks that hold `window_id`."""
        return self.held([window_id])[window_id]

    def stage(self, window: Window, tag: str = "") -> WindowStage:
        """The staging folder of `window`'s outputs (`tag`: a restatement's own)."""
        return WindowStage(self.settings.lake, self.job.name, window.window_id, window.offsets, tag)

    # -- start-up -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the ledger and what the sinks need (idempotent)."""
        if self._prepared:
            return
        self.ledger.ensure_schema()
        if self.index is not None:
            self.ledger.write("create the dedupe key index", self.index.ensure_schema)
        for group in self.groups:
            group.prepare()
        self._prepared = True

    def sink_epoch_floor(self) -> int:
        """The highest epoch any sink has seen, so a new epoch is higher even without a ledger."""
        return max([group.epoch_floor() for group in self.groups], default=0)

    def rebuild_ledger(self, verified: Verified | None = None) -> list[int]:
        """Put back windows the sinks recorded but the ledger lost; return their ids.

        Also re-creates the unit index from the windows' offsets (it can be lost on its own;
        without it, planned input would be planned again as new windows). With `verified`
        (start-up's), the ledger's own checks look only above the verified point and at the
        windows removed since (`onceflow._ledger_verified`).
        """
        job = self.job
        # The ledger has every window through `known.through`: only records above it are read,
        # so a whole ledger costs a count and the sinks' entries since, not their history.
        known = known_windows(self.ledger, verified)
        found: dict[int, Window] = {}
        for group in self.groups:
            for rec in group.recorded_windows(after=known.through):
                if rec.window_id not in known and rec.window_id not in found:
                    found[rec.window_id] = Window(job.name, rec.window_id, rec.offsets, rec.epoch)
        # A sink whose records no longer name every window it holds (a cleaned-up Delta log)
        # cannot rebuild the ledger: the input of the unnamed windows would be planned again.
        whole = known.with_ids(found.keys())
        gaps = [gap for group in self.groups if (gap := group.unrecorded(whole))]
        if gaps:
            raise LedgerError(f"job {job.name}: " + " ".join(gaps) + " Nothing was planned.")
        for wid in sorted(found):
            self.ledger.restore_window(found[wid], job.source.units(found[wid].offsets))
        missing = unindexed_windows(self.ledger, verified)
        self.ledger.restore_units(
            (unit, w.window_id) for w in missing for unit in job.source.units(w.offsets)
        )
        if found:
            _log.warning("job %s: rebuilt %d window(s) from the sinks", job.name, len(found))
        return sorted(found)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Read-only checks in a row see one snapshot of each sink's state (a Delta table's
        load reads its whole checkpoint); nothing may commit to a sink inside."""
        with ExitStack() as pins:
            for group in self.groups:
                pins.enter_context(group.pinned())
            yield

    def check_retention(self) -> None:
        """Refuse when a sink may forget the commit records a replay or a rebuild needs."""
        oldest = self.ledger.oldest_planned_at()
        for group in self.groups:
            elsewhere = any(g.keeps_window_records for g in self.groups if g is not group)
            group.check_retention(oldest, records_elsewhere=elsewhere)

    def start(self, run_id: str) -> int:
        """The start-up of every writing run: prepare, rebuild the ledger from the sinks, check
        retention, take a new epoch above every sink's and the ledger's, claim it in every
        sink, then let the ledger check itself (`onceflow._ledger_check`)."""
        if self.index is not None:
            self.index.reset()
        self.prepare()
        # Read before the checks: removals noted while they run are looked at next time.
        verified, notes = ledger_verified.read(self.ledger)
        with self.pinned():
            self.rebuild_ledger(verified)
            self.check_retention()
            floor = max(self.sink_epoch_floor(), self.ledger.epoch_floor())
        epoch = self.ledger.acquire_epoch(run_id, floor=floor)
        for group in self.groups:
            group.claim_epoch(epoch)
        check_ledger(self, epoch, verified)
        through = contiguous_through(self.ledger, verified)
        ledger_verified.record(self.ledger, epoch, through, notes)
        self._notes = notes
        return epoch

    def ledger_changed(self) -> bool:
        """Whether rows of the ledger were removed since this run's start-up checked it (by
        hand, a restore, another tool): input they recorded as taken would look new."""
        if self._notes is None:
            return False
        return ledger_verified.removed_since(self.ledger, self._notes)
