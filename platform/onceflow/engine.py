"""The engine: plans windows ahead, computes them once, and commits them to every sink once."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow import _window_params as window_params
from onceflow import faults
from onceflow._compute import COUNTS, Computed, compute
from onceflow._identifiers import session_name, spark_sql_name
from onceflow._keyindex import (
    KEY_COL,
    Basis,
    IndexState,
    KeyIndex,
    StagedKeys,
    key_frame,
    spans,
)
from onceflow._ledger_check import check_ledger
from onceflow._staging import WindowStage
from onceflow.errors import ConfigurationError, LedgerError, TransientSinkError
from onceflow.job import Guarantee, Job
from onceflow.ledger import Ledger, Window
from onceflow.settings import Settings
from onceflow.sinks import SinkContext, SinkGroup, SinkOutcome, open_groups
from onceflow.sinks.base import WindowWrite
from onceflow.sinks.postgres.commit import CopyWriter
from onceflow.sinks.writers import (
    WRITERS_PARAM,
    PartitionWriter,
    WritersPlan,
    rows_written,
    run_writers,
)
from onceflow.sources.base import ArrowParse
from onceflow.status import warn_changed_input
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_log = logging.getLogger(__name__)

# Most units (files, table versions) a new window takes unless the run says otherwise.
DEFAULT_MAX_UNITS_PER_WINDOW = 1000
# The internal output carrying a window's kept dedupe keys to the key index's staging table.
KEYS_OUTPUT = "__dedupe_keys"
# Under this prefix and an output's name, the sink write reports the rows of an output that no
# writer writes this time (its sinks held the window).
_ROWS = "__rows/"
# Where a stage's completion marker keeps the basis of its window's dedupe (`Basis.to_json`).
_BASIS = "basis"


@dataclass
class WindowOutputs:
    """A window's outputs ready for the sinks, with its stats.

    Attributes:
        frames: Every output; KEYS_OUTPUT too when the job dedupes.
        stats: Rows read, quarantined, kept, …; None until the sink write counts them
            (`counted`), or `count` does.
        computed: Cached intermediates to release; None when the outputs were read staged.
    """

    frames: dict[str, DataFrame]
    stats: dict[str, Any] | None
    computed: Computed | None = None
    quarantine: bool = False  # whether invalid rows go to a quarantine sink
    #: The window's parameters, when its frames were planned for any window: the Spark jobs
    #: that compute them must run inside `bound`.
    params: dict[str, Any] | None = None
    #: The plan slot the frames come from (with `params`).
    slot: int | None = None
    #: The earlier windows its dedupe saw (None: the job does not dedupe by the key index).
    basis: Basis | None = None
    #: Staged keys its lookups read that `basis` does not count yet: each counts once it is
    #: found whole after the lookups (`KeyIndex.confirm`).
    looked_up: tuple[StagedKeys, ...] = ()

    def bound(
        self,
        spark: SparkSession | None,
        writers: WritersPlan | None = None,
        written: Sequence[PartitionWriter] = (),
    ) -> contextlib.AbstractContextManager[None]:
        """Around the Spark jobs of this thread that compute the frames; with `writers`, the
        job of that plan, writing `written`."""
        if self.params is None or spark is None:
            return contextlib.nullcontext()
        params = self.params
        if writers is not None:
            params = {**params, WRITERS_PARAM: writers.params(written)}
        return window_params.bound(spark, params)

    def count_frames(self, writers: Sequence[PartitionWriter]) -> list[DataFrame]:
        """What the sink write computes too, to know the stats (`counted`): the counts, and
        the rows of each output that no writer writes (a writer counts its output's rows)."""
        if self.stats is not None or self.computed is None:
            return []
        from pyspark.sql import functions as F

        written = {w.output for w in writers}
        return [self.computed.counts_frame()] + [
            df.agg(
                F.lit(_ROWS + name).alias("writer"),
                F.to_json(F.struct(F.count(F.lit(1)).alias("rows"))).alias("result"),
            )
            for name, df in self.frames.items()
            if name not in written
        ]

    def counted(
        self,
        results: Mapping[str, Sequence[Mapping[str, Any]]],
        writers: Sequence[PartitionWriter],
    ) -> dict[str, Any]:
        """The stats, from a sink write that ran `count_frames(writers)`."""
        if self.stats is None:
            counts = {k: v for part in results[COUNTS] for k, v in part.items()}
            self.stats = window_stats(counts, quarantine=self.quarantine)
            by_output = {w.output: rows_written(results[w.key]) for w in writers}
            self.stats["outputs"] = {
                name: by_output[name]
                if name in by_output
                else rows_written(results.get(_ROWS + name, []))
                for name in self.frames
                if name != KEYS_OUTPUT
            }
        return self.stats

    def count(self) -> dict[str, Any]:
        """The stats, counted now (one Spark job) if no sink write counted them."""
        if self.stats is None:
            return self.counted(run_writers(self.frames, [], self.count_frames([])), [])
        return self.stats

    def release(self) -> None:
        if self.computed is not None:
            self.computed.release()


def window_stats(counts: Mapping[str, int], *, quarantine: bool) -> dict[str, Any]:
    """A window's stats from the rows read, invalid and kept."""
    valid = counts["rows_in"] - counts["invalid"]
    return {
        "rows_in": counts["rows_in"],
        "quarantined": counts["invalid"] if quarantine else 0,
        "valid": valid,
        "kept": counts["kept"],
        "duplicates": valid - counts["kept"],
    }


@dataclass
class WindowResult:
    """What a run did with one window."""

    window_id: int
    offsets: dict[str, Any]
    stats: dict[str, Any]
    sinks: dict[str, SinkOutcome] = field(default_factory=dict)
    latency_s: float = 0.0  # planned → completed (every sink committed, ledger marked)
    compute_s: float = 0.0  # reading, parsing, deduplicating and staging the window
    # Planned → committed in every sink: its rows visible everywhere (before it is marked
    # completed and its keys indexed).
    visible_s: float = 0.0

    @property
    def noop(self) -> bool:
        return all(s.already_committed for s in self.sinks.values())


@dataclass
class _Prepared:
    """A window computed and written to every sink's staging, not committed yet."""

    window: Window
    epoch: int
    run_id: str
    started: float
    result: WindowResult = field(init=False)
    out: WindowOutputs | None = None  # None: every sink held the window
    writes: list[tuple[SinkGroup, WindowWrite]] = field(default_factory=list)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    keys: CopyWriter | None = None  # the staged dedupe keys

    def __post_init__(self) -> None:
        w = self.window
        self.result = WindowResult(w.window_id, w.offsets, w.stats or {})

    def staged_keys(self) -> StagedKeys | None:
        """Its kept keys as staged, for the next window's lookups."""
        if self.keys is None or self.keys.key not in self.results:
            return None
        rows = rows_written(self.results[self.keys.key])
        return StagedKeys(self.window.window_id, self.keys.table, rows)


@dataclass
class RunResult:
    """What one run of a job did."""

    job: str
    run_id: str
    epoch: int
    windows: list[WindowResult] = field(default_factory=list)


@dataclass
class Replayed:
    """Per sink, the completed windows it lacked that were committed to it again (`restored`),
    and those that were not (`left`): their input is gone (`gone`, window ids), or an earlier
    window the sink lacks is."""

    restored: dict[str, list[int]] = field(default_factory=dict)
    left: dict[str, list[int]] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)


@dataclass
class RecoveryResult:
    """What a recovery did: completed windows put back into sinks that lost them, then a run."""

    run: RunResult
    restored: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class BackfillResult:
    """What a backfill of chosen windows did."""

    windows: list[WindowResult] = field(default_factory=list)
    noop_windows: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Engine:
    """Runs one job against one set of settings, on one Spark session."""

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
        self._prepared = False
        # A run's windows planned once, for any window, in two slots (one window prepared
        # while the one before it commits): by slot, the outputs; None once a plan was found
        # not to hold for any window (the job's windows are then planned one by one).
        self._planned: dict[int, WindowOutputs] | None = {}
        # Slots are numbered from a base of the engine's own, so no two engines' plans are
        # equal (Spark's cache matches equal plans across a session).
        self._slot_base = secrets.randbits(48) * 2
        # By slot, the writers' step of its last window, for the next window of the slot.
        self._planned_writes: dict[int, WritersPlan] = {}

    @property
    def spark(self) -> SparkSession:
        """The Spark session; an engine opened for status only has none."""
        if self._spark is None:
            raise ConfigurationError(
                f"job {self.job.name}: this engine was opened without Spark (status only)."
            )
        return self._spark

    @property
    def exactly_once(self) -> bool:
        return self.job.guarantee is Guarantee.EXACTLY_ONCE

    @property
    def sink_names(self) -> list[str]:
        return [s.name for s in self.job.sinks]

    @property
    def _tracks_basis(self) -> bool:
        """Whether a window's outputs name what its dedupe saw (a job deduplicated by the key
        index, unless windows are marked completed when planned)."""
        return self.index is not None and self.job.guarantee is not Guarantee.NONE

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

    def rebuild_ledger(self) -> list[int]:
        """Put back windows the sinks recorded but the ledger lost; return their ids.

        Also re-creates the unit index from the windows' offsets (it can be lost on its own;
        without it, planned input would be planned again as new windows).
        """
        known = {w.window_id for w in self.ledger.windows()}
        found: dict[int, Window] = {}
        for group in self.groups:
            for rec in group.recorded_windows():
                if rec.window_id not in known and rec.window_id not in found:
                    found[rec.window_id] = Window(
                        self.job.name, rec.window_id, rec.offsets, rec.epoch
                    )
        # A sink whose records no longer name every window it holds (a cleaned-up Delta log)
        # cannot rebuild the ledger: the input of the unnamed windows would be planned again.
        gaps = [gap for group in self.groups if (gap := group.unrecorded(known | found.keys()))]
        if gaps:
            raise LedgerError(f"job {self.job.name}: " + " ".join(gaps) + " Nothing was planned.")
        for wid in sorted(found):
            self.ledger.restore_window(found[wid], self.job.source.units(found[wid].offsets))
        indexed = self.ledger.indexed_windows()
        missing = [w for w in self.ledger.windows() if w.window_id not in indexed]
        self.ledger.restore_units(
            (unit, w.window_id) for w in missing for unit in self.job.source.units(w.offsets)
        )
        if found:
            _log.warning("job %s: rebuilt %d window(s) from the sinks", self.job.name, len(found))
        return sorted(found)

    def check_retention(self) -> None:
        """Refuse when a sink may forget the commit records a replay or a rebuild needs."""
        row = self.ledger.read(
            "read the oldest window's age",
            lambda conn: conn.execute(
                "SELECT min(planned_at) FROM onceflow.windows WHERE job = %s", (self.job.name,)
            ).fetchone(),
        )
        oldest = row[0] if row else None
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
        self.rebuild_ledger()
        self.check_retention()
        floor = max(self.sink_epoch_floor(), self.ledger.epoch_floor())
        epoch = self.ledger.acquire_epoch(run_id, floor=floor)
        for group in self.groups:
            group.claim_epoch(epoch)
        check_ledger(self, epoch)
        return epoch

    # -- commit state -------------------------------------------------------------------------

    def held(self, window_ids: Sequence[int]) -> dict[int, set[str]]:
        """For each window, the sinks that hold it (one look per group)."""
        state: dict[int, set[str]] = {wid: set() for wid in window_ids}
        for group in self.groups:
            for sink, ids in group.held(window_ids).items():
                for wid in ids:
                    state[wid].add(sink)
        return state

    def committed_sinks(self, window_id: int) -> set[str]:
        """The sinks that hold `window_id`."""
        return self.held([window_id])[window_id]

    def lacking_windows(self) -> dict[str, list[int]]:
        """For each sink, the windows the ledger marks completed that it does not hold.

        A completed window is one every sink held when it was marked; a sink lacking one lost it
        afterwards (a lake deleted, repointed or restored from an older backup). Skipped windows
        were never completed; a window abandoned for a sink (`onceflow windows abandon`) is a
        known gap there, not a lacking window.
        """
        return self._lacking(self.ledger.windows())

    def _lacking(self, windows: Sequence[Window]) -> dict[str, list[int]]:
        completed = [w.window_id for w in windows if w.completed]
        state = self.held(completed)
        abandoned = self.ledger.abandoned()
        lacking: dict[str, list[int]] = {}
        for wid in completed:
            for name in self.sink_names:
                if name not in state[wid] and wid not in abandoned.get(name, ()):
                    lacking.setdefault(name, []).append(wid)
        return lacking

    def check_sinks_hold_completed(self) -> None:
        """Refuse to compute anything while a sink lacks windows the ledger says it holds.

        Without this, a lost dedupe state lets duplicates of earlier records through, and the
        next windows would be committed on top of a hole that no later run fills.
        """
        if self.job.guarantee is Guarantee.NONE:
            return
        lacking = self.lacking_windows()
        problems = {k: v for group in self.groups for k, v in group.state_problems().items()}
        if not lacking and not problems:
            return
        from onceflow.windows import format_windows

        which = "; ".join(
            [f"{name} lacks windows {format_windows(ids)}" for name, ids in lacking.items()]
            + [f"{name} {problem}" for name, problem in problems.items()]
        )
        ids = {wid for wids in lacking.values() for wid in wids}
        windows = [w for w in self.ledger.windows() if w.window_id in ids]
        gone = [w.window_id for w in windows if self.replay_problems(w)]
        lost = (
            f" The input of windows {format_windows(gone)} is gone: no replay can bring them "
            f"back; after reconcile, `onceflow windows abandon {self.job.name} "
            f'{format_windows(gone)} --reason "…"` records the gap and lets runs go on.'
            if gone
            else ""
        )
        raise LedgerError(
            f"job {self.job.name}: {which}, which the ledger records as committed (was the lake "
            "deleted, moved, or restored from an older copy?). Nothing was computed. Run "
            f"`onceflow reconcile {self.job.name}`: it replays the windows those sinks lack and "
            f"restores their commit records; then run the job again.{lost}"
        )

    def incomplete_windows(self, windows: Sequence[Window]) -> dict[int, list[str]]:
        """Windows some sink does not hold, with the sinks that lack them (skipped windows, and
        windows abandoned for a sink, are not incomplete: the operator gave them up)."""
        every = set(self.sink_names)
        state = self.held([w.window_id for w in windows if w.skipped is None])
        abandoned = self.ledger.abandoned()
        incomplete: dict[int, list[str]] = {}
        for wid, held in state.items():
            lacking = sorted(n for n in every - held if wid not in abandoned.get(n, ()))
            if lacking:
                incomplete[wid] = lacking
        return incomplete

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        *,
        max_units_per_window: int | None = None,
        run_id: str | None = None,
        follow: bool = False,
        poll_interval_s: float = 1.0,
        stop: threading.Event | None = None,
        on_window: Callable[[WindowResult], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        max_windows: int | None = None,
    ) -> RunResult:
        """Replay pending windows, then plan and commit windows for all visible new input.

        Args:
            max_units_per_window: Most units (files, table versions) a new window takes.
            run_id: An id for this run, recorded with every commit.
            follow: Keep running and commit new input as it appears, until `stop` is set.
            poll_interval_s: How often `follow` looks for new input.
            stop: Set it to end a `follow` run after the current window.
            on_window: Called after each window.
            on_idle: Called by `follow` each time a look for new input found none, before it
                waits: work that must not overlap a commit (checks) can run there.
            max_windows: Plan at most this many new windows (0: only replay pending ones).
        """
        if max_units_per_window is not None and max_units_per_window < 1:
            raise ConfigurationError("max files (units) per window must be at least 1.")
        run_id = run_id or uuid.uuid4().hex
        # Mistakes a user fixes by hand are refused before anything is taken or computed.
        self.job.source.check_input(self.settings)
        self.prepare()
        for group in self.groups:
            group.check_tables()
        epoch = self.start(run_id)
        self.check_sinks_hold_completed()
        warn_changed_input(self)
        result = RunResult(self.job.name, run_id, epoch)

        def done(window_result: WindowResult) -> None:
            result.windows.append(window_result)
            if on_window:
                on_window(window_result)

        # The windows' plans (a follow run's too) hold from poll to poll; they go at the end.
        try:
            self._process_all(iter(self.ledger.windows(pending_only=True)), epoch, run_id, done)
            # A restatement interrupted by a crash is finished by the next run, with its
            # request's sequence numbers, so each of its windows changes once.
            self.restate(self.planned_restatements(), epoch, run_id)
            stop = stop or threading.Event()
            planned = 0
            while max_windows is None or planned < max_windows:
                found = self._process_all(
                    self._plan_new(epoch, max_units_per_window),
                    epoch,
                    run_id,
                    done,
                    stop=stop,
                    limit=None if max_windows is None else max_windows - planned,
                )
                planned += found
                if (
                    not follow
                    or stop.is_set()
                    or (max_windows is not None and planned >= max_windows)
                ):
                    break
                if found:
                    continue  # more may have landed while these committed: look again at once
                if on_idle is not None:
                    on_idle()
                if stop.wait(poll_interval_s):
                    break
        finally:
            self._forget_plans()
        return result

    def unplanned_units(self) -> list[str]:
        """Visible input no window has taken yet, in source order."""
        source = self.job.source
        return self.ledger.unplanned(source.discover(self.settings, self.ledger.last_offsets()))

    def _plan_new(self, epoch: int, max_units: int | None) -> Iterator[Window]:
        """Plan windows over unplanned input, yielding each as soon as it is planned."""
        units = self.unplanned_units()
        size = max_units or DEFAULT_MAX_UNITS_PER_WINDOW
        for start in range(0, len(units), size):
            chunk = units[start : start + size]
            offsets = self.job.source.offsets(self.settings, chunk)
            window = self.ledger.plan_window(epoch, offsets, chunk)
            if self.job.guarantee is Guarantee.NONE:
                self.ledger.mark_completed(window.window_id)
            yield window

    def process_window(self, window: Window, epoch: int, run_id: str) -> WindowResult:
        """Commit `window` to every sink that does not hold it yet."""
        return self._commit(self._fresh(self._prepare(window, epoch, run_id), epoch, run_id))

    def _process_all(
        self,
        windows: Iterator[Window],
        epoch: int,
        run_id: str,
        done: Callable[[WindowResult], None],
        *,
        stop: threading.Event | None = None,
        limit: int | None = None,
    ) -> int:
        """Process `windows` in order, preparing each (computing it and writing every sink's
        staged copy, on Spark) while the one before it commits; return how many.

        A window is prepared only after the window before it has staged its dedupe keys, and
        its lookups read those staged keys too, so it is deduplicated against every earlier
        window even before that window's commit has put them into the key index. Nothing of a
        window is committed before the windows before it are completed. After each window,
        it stops when `stop` is set or `limit` windows are done.
        """
        # The ledger's sessions are reused from window to window and closed at the end.
        with self.ledger.sessions.kept():
            return self._process_windows(windows, epoch, run_id, done, stop=stop, limit=limit)

    def _forget_plans(self) -> None:
        """Drop the windows' plans and their cache entries (the next windows plan anew)."""
        if self._planned:
            for out in self._planned.values():
                if out.computed is not None:
                    out.computed.forget()
            self._planned = {}
        self._planned_writes.clear()

    def _process_windows(
        self,
        windows: Iterator[Window],
        epoch: int,
        run_id: str,
        done: Callable[[WindowResult], None],
        *,
        stop: threading.Event | None,
        limit: int | None,
    ) -> int:
        count = 0
        window = next(windows, None) if limit is None or limit > 0 else None
        if window is None:
            return count
        ahead = self._prepare(window, epoch, run_id)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="onceflow-prepare") as pool:
            while ahead is not None:
                # The windows before it are completed now: what its dedupe saw must be them.
                current = self._fresh(ahead, epoch, run_id)
                last = (stop is not None and stop.is_set()) or (
                    limit is not None and count + 1 >= limit
                )
                following = None if last else next(windows, None)
                pending: Future[_Prepared] | None = None
                if following is not None and (current.keys is not None or self.index is None):
                    pending = pool.submit(self._prepare, following, epoch, run_id, current)
                try:
                    done(self._commit(current, keep_keys=pending is not None))
                except BaseException:
                    if pending is not None and not pending.cancel():
                        with contextlib.suppress(BaseException):
                            self._discard(pending.result())
                    self._drop_keys(current)
                    raise
                finally:
                    count += 1
                if pending is not None:
                    try:
                        ahead = pending.result()
                    finally:
                        self._drop_keys(current)
                elif following is not None:
                    ahead = self._prepare(following, epoch, run_id)
                else:
                    ahead = None
        return count

    def _prepare(
        self, window: Window, epoch: int, run_id: str, before: _Prepared | None = None
    ) -> _Prepared:
        """Compute `window` and write every sink's staged copy of it (nothing visible yet).

        `before`: the window just before it, prepared but perhaps not completed yet; its staged
        dedupe keys count as seen."""
        started = time.monotonic()
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        held = self.committed_sinks(window.window_id) if self.exactly_once else set()
        prepared = _Prepared(window, epoch, run_id, started)
        prepared.result.sinks.update(
            {name: SinkOutcome(name, committed=False, already_committed=True) for name in held}
        )
        todo = [name for name in self.sink_names if name not in held]
        if not todo:
            return prepared
        staged = before.staged_keys() if before is not None else None
        out = prepared.out = self.outputs(
            window, seen_also=(staged,) if staged else (), planned=True, epoch=epoch
        )
        try:
            prepared.writes = [
                (group, group.begin(window, out.frames, todo, epoch=epoch, run_id=run_id))
                for group in self.groups
            ]
            writers: list[PartitionWriter] = [
                w for _, write in prepared.writes for w in write.writers
            ]
            if self.index is not None:
                prepared.keys = self.index.staging_writer(
                    KEYS_OUTPUT,
                    window.window_id,
                    session_name(self.job.name, epoch),
                    epoch=epoch,
                    fenced=self.exactly_once,
                )
                faults.point("keys_staging", window.window_id)
                writers.append(prepared.keys)
            prepared.results = self._write(window, out, writers, prepared.writes, epoch)
            prepared.result.compute_s = time.monotonic() - started
            prepared.result.stats = out.counted(prepared.results, writers)
            self._confirm(out)
        except BaseException:
            self._discard(prepared)
            raise
        return prepared

    def _confirm(self, out: WindowOutputs) -> None:
        """Count in `out`'s basis the staged keys its lookups read, if still whole (the lookups
        are done: they ran in the jobs that wrote the window's staged copies)."""
        if self.index is not None and out.basis is not None and out.looked_up:
            out.basis = self.index.confirm(out.basis, out.looked_up)
        out.looked_up = ()

    def _fresh(self, prepared: _Prepared, epoch: int, run_id: str) -> _Prepared:
        """`prepared` if what its dedupe saw is still every earlier window the ledger plans
        and did not skip; else the window prepared again (once the key index holds them).

        It differs when staged keys it read were lost (a server crash-restart empties UNLOGGED
        tables), or when an earlier window it saw was skipped since.

        Raises:
            LedgerError: Prepared again, it still differs.
        """
        window = prepared.window
        for attempt in range(2):
            out = prepared.out
            if out is None or out.basis is None:
                return prepared
            state = self.ensure_index(window.window_id, epoch)
            assert state is not None
            due = state.due
            if out.basis == due:
                return prepared
            if attempt:
                raise LedgerError(
                    f"job {self.job.name}: window {window.window_id} must be deduplicated "
                    f"against {due}, but the dedupe key index gives {out.basis}; nothing of it "
                    f"was committed. Run `onceflow run {self.job.name}` again; if this repeats, "
                    f"`onceflow status {self.job.name}` lists the windows pending before it."
                )
            _log.warning(
                "window %d: its dedupe saw %s but must see %s; computing it again",
                window.window_id,
                out.basis,
                due,
            )
            self._discard(prepared)
            prepared = self._prepare(window, epoch, run_id)
        return prepared

    def _commit(self, prepared: _Prepared, keep_keys: bool = False) -> WindowResult:
        """Commit a prepared window to its sinks, in order, and mark it completed; its staged
        dedupe keys enter the key index in that same transaction. `keep_keys`: leave the
        staged keys for the next window's lookups (it drops them)."""
        window, epoch, run_id = prepared.window, prepared.epoch, prepared.run_id
        result, out = prepared.result, prepared.out
        if out is None:  # every sink held it
            self.ledger.mark_completed(window.window_id)
            WindowStage(self.settings.lake, self.job.name, window.window_id, {}).discard()
            result.latency_s = result.visible_s = time.monotonic() - prepared.started
            return result
        try:
            self.ledger.record_stats(window.window_id, result.stats)
            faults.point("before_sinks", window.window_id)
            for group, write in prepared.writes:
                with out.bound(self._spark):  # a staged copy lost is written again
                    outcomes = group.finish(
                        window, write, prepared.results, out.frames, epoch=epoch,
                        run_id=run_id, exactly_once=self.exactly_once,
                    )  # fmt: skip
                result.sinks.update(outcomes)
                faults.point(f"after_{group.kind}", window.window_id)
            faults.point("after_commits", window.window_id)
            result.visible_s = time.monotonic() - prepared.started
            if self.exactly_once:
                self.ledger.check_epoch(epoch)
            self._complete(
                window.window_id, prepared.keys, prepared.results, _versions(result.sinks)
            )
        finally:
            out.release()
            if not keep_keys:
                self._drop_keys(prepared)
        WindowStage(self.settings.lake, self.job.name, window.window_id, window.offsets).discard()
        result.latency_s = time.monotonic() - prepared.started
        return result

    def _discard(self, prepared: _Prepared) -> None:
        """Drop a prepared window that will not be committed (its staged copies are never
        committed; a later prepare of the window writes new ones)."""
        if prepared.out is not None:
            prepared.out.release()
        self._drop_keys(prepared)

    def _drop_keys(self, prepared: _Prepared) -> None:
        if prepared.keys is not None and self.index is not None:
            self.index.drop_staging(prepared.keys.table)

    def _write(
        self,
        window: Window,
        out: WindowOutputs,
        writers: list[PartitionWriter],
        writes: list[tuple[SinkGroup, WindowWrite]],
        epoch: int,
    ) -> dict[str, list[dict[str, Any]]]:
        """Run every writer in one Spark job (built once per plan slot when the outputs come
        from one). If that job fails, each group's writers (and the key index's) run again on
        their own, unless a newer run took over (staging copies refuse then); nothing is
        committed before `finish`."""
        try:
            if out.slot is None:
                with out.bound(self._spark):
                    return run_writers(out.frames, writers, out.count_frames(writers))
            plan = self._planned_writes.get(out.slot)
            if plan is None or not plan.fits(out.frames, writers):
                plan = WritersPlan(out.frames, writers, out.count_frames(writers))
                self._planned_writes[out.slot] = plan
            cache_kept = out.computed is not None and out.computed.cache_kept
            with out.bound(self._spark, plan, writers):
                return plan.run(writers, cache_kept=cache_kept)
        except Exception as exc:
            _log.warning(
                "window %d: the write job failed (%s); writing each sink group on its own",
                window.window_id,
                type(exc).__name__,
            )
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        with out.bound(self._spark):
            out.count()
            grouped = [write.writers for _, write in writes]
            grouped.append([w for w in writers if not any(w in g for g in grouped)])
            results: dict[str, list[dict[str, Any]]] = {}
            for group_writers in grouped:
                try:
                    results.update(run_writers(out.frames, group_writers))
                except Exception as exc:
                    # A server that is gone is named as such (after its retries), not as a write.
                    self.ledger.read(
                        "reach the server after a failed write", lambda c: c.execute(";")
                    )
                    raise TransientSinkError(
                        f"window {window.window_id}: writing its rows failed on an executor "
                        f"({type(exc).__name__}); nothing was committed. Run the job again."
                    ) from None
            return results

    def _complete(
        self,
        window_id: int,
        keys: CopyWriter | None,
        results: dict[str, list[dict[str, Any]]],
        versions: Mapping[str, int] | None = None,
    ) -> bool:
        """Mark the window completed, moving its staged dedupe keys into the key index in the
        same transaction (and recording the sinks' `versions` holding it, for lineage); False
        if the keys were lost (the next window indexes them from the state sink)."""
        index = self.index
        if keys is None or index is None or keys.key not in results:
            self.ledger.mark_completed(window_id, versions=versions)
            return index is None
        rows = rows_written(results[keys.key])
        indexed: list[bool] = []

        def add(conn: Any) -> None:
            indexed[:] = [index.add(conn, keys.table, [window_id], rows)]

        self.ledger.mark_completed(window_id, also=add, versions=versions)
        if not indexed[0]:
            _log.warning("window %d: its staged dedupe keys were lost", window_id)
        return indexed[0]

    def recover(self, run_id: str) -> RecoveryResult:
        """Put back completed windows a sink lost (as reconcile does), then run: pending windows,
        unfinished restatements and input no window has planned yet."""
        restored: dict[str, list[int]] = {}
        if self.job.guarantee is not Guarantee.NONE and self.lacking_windows():
            restored = self.replay_lacking(self.start(run_id), run_id).restored
        return RecoveryResult(self.run(run_id=run_id), restored)

    def replay_lacking(self, epoch: int, run_id: str) -> Replayed:
        """Commit, in window order, the completed windows some sink lacks, to those sinks only.

        Window order matters: each replayed window's dedupe sees the windows before it, which
        the state sink holds again by then. Windows whose input (and stage) is gone stay lacking,
        and so do later windows in the sinks that lack one of them: committed on top of the
        gap, they would hide it. Once the operator abandons the gap for those sinks (`onceflow
        windows abandon`), the next reconcile replays them.
        """
        windows = {w.window_id: w for w in self.ledger.windows()}
        lacking = self._lacking(list(windows.values()))
        for group in self.groups:
            group.prepare_replay()
        replayed = Replayed()
        blocked: set[str] = set()  # sinks lacking a window whose input is gone
        try:
            for wid in sorted({wid for wids in lacking.values() for wid in wids}):
                window = windows[wid]
                sinks = [name for name, ids in lacking.items() if wid in ids]
                problems = self.replay_problems(window)
                if problems:
                    _log.warning("window %d cannot be replayed: %s", wid, "; ".join(problems[:3]))
                    replayed.gone.append(wid)
                    blocked.update(sinks)
                elif not blocked.intersection(sinks):
                    self.process_window(window, epoch, run_id)
                    for name in sinks:
                        replayed.restored.setdefault(name, []).append(wid)
                    continue
                for name in sinks:
                    replayed.left.setdefault(name, []).append(wid)
        finally:
            for group in self.groups:
                group.end_replay()
            self._forget_plans()
        return replayed

    def replay_problems(self, window: Window) -> list[str]:
        """What keeps `window` from being computed again (its input gone or changed, and no
        complete stage of it); empty when it can be replayed."""
        problems = self.job.source.check_available(self.settings, window.offsets)
        if problems:
            stage = WindowStage(self.settings.lake, self.job.name, window.window_id, window.offsets)
            if stage.complete() is not None:
                return []
        return problems

    def skip(self, window_ids: Sequence[int], reason: str, run_id: str | None = None) -> list[int]:
        """Give up pending windows whose input is gone or changed, recording why.

        Checks first (a refusal records nothing, not even an epoch), then takes a new epoch, so
        a run working on the windows is fenced, and checks again under it. A window some sink
        already holds cannot be skipped: the sinks would disagree for good; its staged output or
        its input is needed to finish it.

        Raises:
            ConfigurationError: No reason, a window never planned, completed, or partly held.
        """
        from onceflow.windows import format_windows

        if not reason.strip():
            raise ConfigurationError("say why the windows are skipped (--reason); it is recorded.")

        def skippable() -> list[Window]:
            windows = []
            for wid in sorted(set(window_ids)):
                window = self.ledger.window(wid)
                if window is None:
                    raise ConfigurationError(
                        f"job {self.job.name}: window {wid} was never planned; nothing was "
                        "recorded."
                    )
                if window.completed:
                    raise ConfigurationError(
                        f"job {self.job.name}: window {wid} is committed in every sink; only "
                        "pending windows can be skipped (use restate to change a committed one). "
                        "Nothing was recorded."
                    )
                windows.append(window)
            held = self.held([w.window_id for w in windows if w.skipped is None])
            partly = {wid: sorted(names) for wid, names in held.items() if names}
            if partly:
                which = "; ".join(
                    f"window {w} is held by {', '.join(n)}" for w, n in partly.items()
                )
                raise ConfigurationError(
                    f"job {self.job.name}: {which}. Skipping would leave the sinks apart for "
                    "good; restore the window's input and run the job to finish it instead. "
                    "Nothing was recorded."
                )
            return windows

        # Checked before the epoch (which fences a running job) and again under it.
        self.prepare()
        self.rebuild_ledger()
        skippable()
        epoch = self.start(run_id or f"skip-{uuid.uuid4().hex}")
        windows = skippable()
        for window in windows:
            if window.skipped is None:
                self.ledger.skip_window(epoch, window.window_id, reason.strip())
                WindowStage(self.settings.lake, self.job.name, window.window_id, {}).discard()
        _log.warning(
            "job %s: windows %s skipped: %s",
            self.job.name,
            format_windows([w.window_id for w in windows]),
            reason,
        )
        return [w.window_id for w in windows]

    # -- restatements -------------------------------------------------------------------------

    def planned_restatements(self) -> list[tuple[Window, int]]:
        """Restatements written ahead but not finished, as (window, sequence number)."""
        out = []
        for seq, wid, _ in self.ledger.pending_restatements():
            window = self.ledger.window(wid)
            if window is not None:
                out.append((window, seq))
        return out

    def restate(
        self, todo: Sequence[tuple[Window, int]], epoch: int, run_id: str
    ) -> list[WindowResult]:
        """Apply planned restatements: every check first, then each window in every sink."""
        from onceflow.restate import check_unfinished

        check_unfinished(self, todo)
        results = []
        for window, seq in todo:
            t0 = time.monotonic()
            tag = f"-r{seq}"
            out = self.outputs(window, stage_tag=tag, epoch=epoch)
            result = WindowResult(window.window_id, window.offsets, out.count())
            try:
                for group in self.groups:
                    result.sinks.update(
                        group.restate(window, out.frames, epoch=epoch, run_id=run_id, seq=seq)
                    )
            finally:
                out.release()
            faults.point("restated", window.window_id)
            result.visible_s = time.monotonic() - t0
            self.ledger.record_stats(window.window_id, result.stats)
            self.ledger.complete_restatement(seq, window.window_id, _versions(result.sinks))
            WindowStage(
                self.settings.lake, self.job.name, window.window_id, window.offsets, tag
            ).discard()
            result.latency_s = time.monotonic() - t0
            results.append(result)
        return results

    def backfill(self, window_ids: Sequence[int], run_id: str) -> BackfillResult:
        """Bring chosen past windows into every sink: pending ones are replayed; a window every
        sink holds is left alone and said to be; a completed window a sink lacks is damage
        from outside onceflow, which only reconcile repairs.

        Raises:
            ConfigurationError: A window was never planned.
        """
        self.prepare()
        last = self.ledger.last_window_id()
        unplanned = [wid for wid in window_ids if wid > last]
        if unplanned:
            from onceflow.windows import format_windows

            raise ConfigurationError(
                f"windows {format_windows(unplanned)} were never planned (the last planned window "
                f"is {last}); windows are planned by a run for new data."
            )
        report = BackfillResult()
        state = self.held(window_ids)
        for sink, ids in self.ledger.abandoned().items():  # a known gap is not damage
            for wid in set(ids) & set(window_ids):
                state[wid].add(sink)
        every = set(self.sink_names)
        replay = False
        for wid in window_ids:
            window = self.ledger.window(wid)
            if window is not None and window.skipped is not None:
                report.notes.append(f"window {wid} was skipped ({window.skipped}); left alone.")
                continue
            if state[wid] >= every:
                report.noop_windows.append(wid)
                continue
            if window is not None and window.completed:
                report.notes.append(
                    f"window {wid} is marked completed but {sorted(every - state[wid])} do not "
                    "hold it: damage from outside onceflow; run reconcile (the recovery job)."
                )
            else:
                replay = True
        if replay:
            report.windows = self.run(run_id=run_id, max_windows=0).windows
        return report

    # -- computing ----------------------------------------------------------------------------

    def ensure_index(self, window_id: int, epoch: int | None = None) -> IndexState | None:
        """Make the key index hold exactly the completed windows before `window_id`: put in
        those it lacks, from the dedupe state sink (made before the index existed, or their
        staged keys were lost), and take out those the ledger does not mark completed (a
        ledger lost or changed). Return what the index and the ledger then hold; None if
        the job does not dedupe by the index."""
        dedupe, index = self.job.dedupe, self.index
        if dedupe is None or index is None:
            return None
        state = index.state(window_id)
        if state.stale:
            _log.warning(
                "job %s: the dedupe key index held %s, which the ledger does not mark "
                "completed; they are taken out of it",
                self.job.name,
                Basis(spans(state.stale)),
            )
            index.forget(state.stale)
            state = state.indexing((), state.stale)
        missing = state.missing
        if not missing:
            return state
        gap = sorted(set(missing) & self.ledger.abandoned().get(dedupe.state_sink, set()))
        if gap:
            from onceflow.windows import format_windows

            raise LedgerError(
                f"job {self.job.name}: the dedupe key index lacks windows "
                f"{format_windows(missing)}, and windows {format_windows(gap)} were abandoned "
                f"for the dedupe state sink {dedupe.state_sink}: their keys cannot be indexed "
                "again, and later duplicates of their records would pass. Nothing was "
                "computed. Restore onceflow.dedupe_keys and onceflow.dedupe_windows from a "
                "backup of the ledger database."
            )
        group = self.group_of[dedupe.state_sink]
        through = group.committed_through()[dedupe.state_sink]
        if through < missing[-1] and self._unskipped(through, missing[-1] + 1):
            raise LedgerError(
                f"job {self.job.name}: dedupe state {dedupe.state_sink} holds windows up to "
                f"{through}, but window {window_id} needs every window before it (was the lake "
                "lost or replaced?). Run `onceflow reconcile " + self.job.name + "`."
            )
        _log.info(
            "job %s: indexing the dedupe keys of %d window(s) from %s",
            self.job.name,
            len(missing),
            dedupe.state_sink,
        )
        seen = group.seen_keys(self.spark, dedupe.state_sink, list(dedupe.key), only=missing)
        writer = index.staging_writer(
            KEYS_OUTPUT,
            missing[-1],
            session_name(self.job.name, epoch),
            epoch=epoch,
            tag="index",
            fenced=self.exactly_once,
        )
        try:
            rows = 0
            if seen is not None:
                frame = key_frame(seen, dedupe.key, "__seen_in")
                rows = rows_written(run_writers({KEYS_OUTPUT: frame}, [writer])[writer.key])

            def add(conn: Any) -> bool:
                return index.add(conn, writer.table, missing, rows)

            if not self.ledger.write("index the dedupe keys", add):
                raise TransientSinkError("the dedupe key staging table lost rows; run again")
        finally:
            index.drop_staging(writer.table)
        return state.indexing(missing)

    def _unskipped(self, after: int, before: int) -> list[int]:
        """Windows between `after` and `before` (exclusive) that were not skipped."""
        skipped = {wid for wid, _ in self.ledger.skipped_windows()}
        return [w for w in range(after + 1, before) if w not in skipped]

    def _frames(self, computed: Computed, names: Sequence[str]) -> dict[str, DataFrame]:
        """The sinks' frames of a computation (and the key index's)."""
        frames = {
            name: df.drop(WINDOW_COL) if WINDOW_COL in df.columns else df
            for name, df in computed.outputs.items()
            if name in names
        }
        dedupe = self.job.dedupe
        if dedupe is not None:
            state = self.job.sink(dedupe.state_sink)
            if "_window_id" not in frames[state.output].columns:
                computed.forget()
                raise ConfigurationError(
                    f"sink {state.name} holds the job's dedupe state, but its rows have no "
                    "`_window_id` column; add it in the transform (the window's id, from ctx)."
                )
        if self.index is not None:
            frames[KEYS_OUTPUT] = computed.kept.where(
                f"{spark_sql_name(KEY_COL)} IS NOT NULL"
            ).selectExpr(spark_sql_name(KEY_COL), f"{spark_sql_name(WINDOW_COL)} AS window_id")
        return frames

    def _planned_outputs(
        self, window: Window, names: Sequence[str], seen_also: Sequence[StagedKeys]
    ) -> WindowOutputs | None:
        """The window's outputs from the plan of its slot (made now if the slot has none), or
        None if the job's plan does not hold for any window, or the source cannot read this
        window with it.

        Windows alternate between two slots, so the window committing and the one being
        prepared never share a plan: Spark takes cached rows for any equal plan. A slot's
        window releases its cached rows when it is committed or dropped, before the slot's
        next window is prepared."""
        job, index, dedupe = self.job, self.index, self.job.dedupe
        planned = self._planned
        if (
            planned is None
            or not isinstance(job.parse, ArrowParse)
            or (dedupe is not None and not job.parse.keeps_order)
            or self._spark is None
            or not window_params.supported(self._spark)
        ):
            return None
        read = job.source.window_read(self.settings, window.offsets)
        if read is None:
            return None
        slot = self._slot_base + window.window_id % 2
        staged = [s.table for s in seen_also]
        params = {"read": read, "window_id": window.window_id, "staged": staged}
        quarantine = job.quarantine_sink is not None
        plan = planned.get(slot)
        if plan is not None:
            assert plan.computed is not None
            if plan.computed.cached:  # its last window is not released: plan this one alone
                return None
            plan.computed.persist()
            return WindowOutputs(dict(plan.frames), None, plan.computed, quarantine, params, slot)
        computed = compute(
            self.spark,
            job,
            self.settings,
            [window],
            lookup=(
                index.lookup(dedupe.key, window.window_id)
                if index is not None and dedupe is not None
                else None
            ),
            window_column=False,
            slot=slot,
        )
        if not computed.any_window:
            computed.release()
            self._planned = None
            _log.info("job %s: its windows are planned one by one", job.name)
            return None
        frames = self._frames(computed, names)
        out = WindowOutputs(frames, None, computed, quarantine, params, slot)
        planned[slot] = WindowOutputs(dict(frames), None, computed, quarantine)
        return out

    def outputs(
        self,
        window: Window,
        *,
        stage_tag: str = "",
        seen_also: Sequence[StagedKeys] = (),
        planned: bool = False,
        epoch: int | None = None,
    ) -> WindowOutputs:
        """The window's outputs and stats, the same rows for every sink and every retry.

        A deterministic job computes them again on a replay, from cached intermediates within
        a run; any other job stages them once (Parquet under the lake) and reuses the stage
        while what its dedupe saw (`WindowOutputs.basis`, kept in the stage's marker) is
        still every earlier window the ledger plans and did not skip. `seen_also`: staged keys
        of earlier windows not in the key index yet, which its lookups read too. `planned`:
        the outputs may come from a plan made for any window of the run (then their Spark
        jobs run inside `WindowOutputs.bound`, and their lookups with them).
        """
        state = self.ensure_index(window.window_id, epoch)
        # What the lookups will see: the index as it is now, and `seen_also` once found whole.
        basis = state.indexed if self._tracks_basis and state is not None else None
        looked_up = tuple(seen_also) if basis is not None else ()
        names = sorted({s.output for s in self.job.sinks})
        if planned and self.job.deterministic:
            out = self._planned_outputs(window, names, seen_also)
            if out is not None:
                out.basis, out.looked_up = basis, looked_up
                return out
        stage = None
        if not self.job.deterministic:
            stage = WindowStage(
                self.settings.lake, self.job.name, window.window_id, window.offsets, stage_tag
            )
            staged_names = [*names, KEYS_OUTPUT] if self.index is not None else names
            stats = stage.complete()
            if stats is not None:
                recorded = stats.pop(_BASIS, None)
                was = Basis.from_json(recorded) if recorded is not None else None
                if basis is not None and state is not None and (was is None or was != state.due):
                    _log.warning(
                        "window %d: its stage was deduplicated against %s, but the ledger now "
                        "plans %s before it; computing it again",
                        window.window_id,
                        was if was is not None else "unrecorded windows",
                        state.due,
                    )
                elif stage.intact(stats, staged_names):
                    return WindowOutputs(
                        {name: stage.read(self.spark, name) for name in staged_names},
                        stats,
                        basis=was,
                    )
                else:
                    _log.warning(
                        "window %d: its stage lost rows; computing it again", window.window_id
                    )
                stage.clear()
        index, dedupe = self.index, self.job.dedupe
        computed = compute(
            self.spark,
            self.job,
            self.settings,
            [window],
            lookup=(
                index.lookup(dedupe.key, window.window_id, [s.table for s in seen_also])
                if index is not None and dedupe is not None
                else None
            ),
            window_column=False,
        )
        frames = self._frames(computed, names)
        out = WindowOutputs(
            frames,
            None,
            computed,
            quarantine=self.job.quarantine_sink is not None,
            basis=basis,
            looked_up=looked_up,
        )
        if stage is None:
            return out
        try:
            stats = out.count()
            staged = {name: stage.write(name, frames[name]) for name in frames}
            stats["outputs"] = {name: stage.rows(name) for name in frames}
            self._confirm(out)  # every lookup ran in the jobs above
            marker = stats if out.basis is None else {**stats, _BASIS: out.basis.to_json()}
            stage.finish(marker)
        except Exception:
            # Outputs of code that raised are never kept, in part or whole: the window is
            # computed afresh, with the code as it is then.
            _clear_quietly(stage)
            raise
        finally:
            out.release()
        return WindowOutputs(staged, stats, basis=out.basis)


def _clear_quietly(stage: WindowStage) -> None:
    try:
        stage.clear()
    except Exception:  # a stage without its marker is never read; the next attempt clears it
        _log.warning("window %d: could not remove its unfinished stage", stage.window_id)


def _versions(outcomes: Mapping[str, SinkOutcome]) -> dict[str, int]:
    """The data versions (Delta table versions) this run's commits made, by sink."""
    return {
        name: o.delta_version
        for name, o in outcomes.items()
        if o.committed and o.delta_version is not None
    }


def build_engine(
    job: Job,
    settings: Settings,
    spark: SparkSession | None,
    dsn: str,
    guarantee: Guarantee | str | None = None,
) -> Engine:
    """Make an engine after checking the settings' folders."""
    settings.check_folders()
    return Engine(job, settings, spark, dsn, guarantee=guarantee)
