"""The engine: plans windows ahead, computes them once, and commits them to every sink once."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow import faults
from onceflow._compute import KEPT, PARSED, compute
from onceflow._staging import WindowStage
from onceflow.errors import ConfigurationError, LedgerError
from onceflow.job import Guarantee, Job
from onceflow.ledger import Ledger, Window
from onceflow.settings import Settings
from onceflow.sinks import SinkContext, SinkGroup, SinkOutcome, open_groups
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_log = logging.getLogger(__name__)

# Most units (files, table versions) a new window takes unless the run says otherwise.
DEFAULT_MAX_UNITS_PER_WINDOW = 1000


@dataclass
class WindowResult:
    """What a run did with one window."""

    window_id: int
    offsets: dict[str, Any]
    stats: dict[str, Any]
    sinks: dict[str, SinkOutcome] = field(default_factory=dict)
    latency_s: float = 0.0
    compute_s: float = 0.0  # reading, parsing, deduplicating and staging the window

    @property
    def noop(self) -> bool:
        return all(s.already_committed for s in self.sinks.values())


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
    and those that could not be, their input being gone (`left`)."""

    restored: dict[str, list[int]] = field(default_factory=dict)
    left: dict[str, list[int]] = field(default_factory=dict)


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
        self._prepared = False

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

    # -- start-up -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the ledger and what the sinks need (idempotent)."""
        if self._prepared:
            return
        self.ledger.ensure_schema()
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
        """Refuse when a sink may forget the commit records a replay needs."""
        row = self.ledger.read(
            "read the oldest window's age",
            lambda conn: conn.execute(
                "SELECT min(planned_at) FROM onceflow.windows WHERE job = %s", (self.job.name,)
            ).fetchone(),
        )
        oldest = row[0] if row else None
        for group in self.groups:
            group.check_retention(oldest)

    def start(self, run_id: str) -> int:
        """The start-up of every writing run: prepare, rebuild the ledger from the sinks, check
        retention, take a new epoch above every sink's, and claim it in every sink."""
        self.prepare()
        self.rebuild_ledger()
        self.check_retention()
        epoch = self.ledger.acquire_epoch(run_id, floor=self.sink_epoch_floor())
        for group in self.groups:
            group.claim_epoch(epoch)
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
        were never completed.
        """
        return self._lacking(self.ledger.windows())

    def _lacking(self, windows: Sequence[Window]) -> dict[str, list[int]]:
        completed = [w.window_id for w in windows if w.completed]
        state = self.held(completed)
        lacking: dict[str, list[int]] = {}
        for wid in completed:
            for name in self.sink_names:
                if name not in state[wid]:
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
        if not lacking:
            return
        from onceflow.windows import format_windows

        which = "; ".join(
            f"{name} lacks windows {format_windows(ids)}" for name, ids in lacking.items()
        )
        raise LedgerError(
            f"job {self.job.name}: {which}, which the ledger records as committed (was the lake "
            "deleted, moved, or restored from an older copy?). Nothing was computed. Run "
            f"`onceflow reconcile {self.job.name}`: it replays the windows those sinks lack and "
            "restores their commit records; then run the job again."
        )

    def incomplete_windows(self, windows: Sequence[Window]) -> dict[int, list[str]]:
        """Windows some sink does not hold, with the sinks that lack them (skipped windows are
        not incomplete: the operator gave them up)."""
        every = set(self.sink_names)
        state = self.held([w.window_id for w in windows if w.skipped is None])
        return {wid: sorted(every - held) for wid, held in state.items() if held != every}

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
            max_windows: Plan at most this many new windows (0: only replay pending ones).
        """
        if max_units_per_window is not None and max_units_per_window < 1:
            raise ConfigurationError("max files (units) per window must be at least 1.")
        run_id = run_id or uuid.uuid4().hex
        epoch = self.start(run_id)
        self.check_sinks_hold_completed()
        result = RunResult(self.job.name, run_id, epoch)

        def done(window_result: WindowResult) -> None:
            result.windows.append(window_result)
            if on_window:
                on_window(window_result)

        for window in self.ledger.windows(pending_only=True):
            done(self.process_window(window, epoch, run_id))
        # A restatement interrupted by a crash is finished by the next run, with its request's
        # sequence numbers, so each of its windows changes once.
        self.restate(self.planned_restatements(), epoch, run_id)
        stop = stop or threading.Event()
        planned = 0
        while max_windows is None or planned < max_windows:
            for window in self._plan_new(epoch, max_units_per_window):
                done(self.process_window(window, epoch, run_id))
                planned += 1
                if stop.is_set() or (max_windows is not None and planned >= max_windows):
                    break
            if not follow or stop.is_set() or (max_windows is not None and planned >= max_windows):
                break
            stop.wait(poll_interval_s)
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
        started = time.monotonic()
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        held = self.committed_sinks(window.window_id) if self.exactly_once else set()
        result = WindowResult(window.window_id, window.offsets, window.stats or {})
        for name in held:
            result.sinks[name] = SinkOutcome(name, committed=False, already_committed=True)
        todo = [name for name in self.sink_names if name not in held]
        if not todo:
            self.ledger.mark_completed(window.window_id)
            result.latency_s = time.monotonic() - started
            return result
        t0 = time.monotonic()
        outputs, stats = self.outputs(window)
        result.compute_s = time.monotonic() - t0
        result.stats = stats
        self.ledger.record_stats(window.window_id, stats)
        faults.point("before_sinks", window.window_id)
        for group in self.groups:
            names = [n for n in group.names if n in todo]
            if names:
                result.sinks.update(
                    group.commit(
                        window, outputs, names, epoch=epoch, run_id=run_id,
                        exactly_once=self.exactly_once,
                    )
                )  # fmt: skip
            faults.point(f"after_{group.kind}", window.window_id)
        faults.point("after_commits", window.window_id)
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        self.ledger.mark_completed(window.window_id)
        WindowStage(self.settings.lake, self.job.name, window.window_id, window.offsets).discard()
        result.latency_s = time.monotonic() - started
        return result

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
        the state sink holds again by then. Windows whose input (and stage) is gone stay lacking.
        """
        windows = {w.window_id: w for w in self.ledger.windows()}
        lacking = self._lacking(list(windows.values()))
        gone: set[int] = set()
        for wid in sorted({wid for wids in lacking.values() for wid in wids}):
            window = windows[wid]
            stage = WindowStage(self.settings.lake, self.job.name, wid, window.offsets)
            problems = self.job.source.check_available(self.settings, window.offsets)
            if problems and stage.complete() is None:
                _log.warning("window %d cannot be replayed: %s", wid, "; ".join(problems[:3]))
                gone.add(wid)
                continue
            self.process_window(window, epoch, run_id)
        replayed = Replayed()
        for sink, ids in lacking.items():
            for wid in ids:
                (replayed.left if wid in gone else replayed.restored).setdefault(sink, []).append(
                    wid
                )
        return replayed

    def skip(self, window_ids: Sequence[int], reason: str, run_id: str | None = None) -> list[int]:
        """Give up pending windows whose input is gone or changed, recording why.

        Takes a new epoch first, so a run working on the windows is fenced. A window some sink
        already holds cannot be skipped: the sinks would disagree for good; its staged output or
        its input is needed to finish it.

        Raises:
            ConfigurationError: No reason, a window never planned, completed, or partly held.
        """
        from onceflow.windows import format_windows

        if not reason.strip():
            raise ConfigurationError("say why the windows are skipped (--reason); it is recorded.")
        epoch = self.start(run_id or f"skip-{uuid.uuid4().hex}")
        windows = []
        for wid in sorted(set(window_ids)):
            window = self.ledger.window(wid)
            if window is None:
                raise ConfigurationError(f"job {self.job.name}: window {wid} was never planned.")
            if window.completed:
                raise ConfigurationError(
                    f"job {self.job.name}: window {wid} is committed in every sink; only pending "
                    "windows can be skipped (use restate to change a committed one)."
                )
            windows.append(window)
        held = self.held([w.window_id for w in windows if w.skipped is None])
        partly = {wid: sorted(names) for wid, names in held.items() if names}
        if partly:
            which = "; ".join(f"window {w} is held by {', '.join(n)}" for w, n in partly.items())
            raise ConfigurationError(
                f"job {self.job.name}: {which}. Skipping would leave the sinks apart for good; "
                "restore the window's input and run the job to finish it instead."
            )
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
        for window, _ in todo:
            for group in self.groups:
                group.check_restate(window)
        results = []
        for window, seq in todo:
            t0 = time.monotonic()
            tag = f"-r{seq}"
            outputs, stats = self.outputs(window, stage_tag=tag)
            result = WindowResult(window.window_id, window.offsets, stats)
            for group in self.groups:
                result.sinks.update(
                    group.restate(window, outputs, epoch=epoch, run_id=run_id, seq=seq)
                )
            faults.point("restated", window.window_id)
            self.ledger.record_stats(window.window_id, stats)
            self.ledger.complete_restatement(seq)
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

    def seen_keys(self, window_id: int) -> DataFrame | None:
        """Dedupe keys that windows before `window_id` kept (None without dedupe)."""
        dedupe = self.job.dedupe
        if dedupe is None:
            return None
        group = self.group_of[dedupe.state_sink]
        through = group.committed_through()[dedupe.state_sink]
        if self.exactly_once and through < window_id - 1 and self._unskipped(through, window_id):
            raise LedgerError(
                f"job {self.job.name}: dedupe state {dedupe.state_sink} holds windows up to "
                f"{through}, but window {window_id} needs every window before it (was the lake "
                "lost or replaced?). Run `onceflow reconcile " + self.job.name + "`."
            )
        return group.seen_keys(self.spark, dedupe.state_sink, list(dedupe.key), before=window_id)

    def _unskipped(self, after: int, before: int) -> list[int]:
        """Windows between `after` and `before` (exclusive) that were not skipped."""
        skipped = {wid for wid, _ in self.ledger.skipped_windows()}
        return [w for w in range(after + 1, before) if w not in skipped]

    def outputs(
        self, window: Window, *, use_stage: bool = True, stage_tag: str = ""
    ) -> tuple[dict[str, DataFrame], dict[str, Any]]:
        """The window's outputs, staged once so every sink and every retry sees the same rows."""
        stage = WindowStage(
            self.settings.lake, self.job.name, window.window_id, window.offsets, stage_tag
        )
        names = sorted({s.output for s in self.job.sinks})
        stats = stage.complete() if use_stage else None
        if stats is not None and stage.intact(stats, names):
            return {name: stage.read(self.spark, name) for name in names}, stats
        if stats is not None:
            _log.warning("window %d: its stage lost rows; computing it again", window.window_id)
            stage.clear()
        computed = compute(
            self.spark,
            self.job,
            self.settings,
            [window],
            stage.root,
            seen=self.seen_keys(window.window_id),
        )
        staged = {
            name: stage.write(name, computed.outputs[name].drop(WINDOW_COL)) for name in names
        }
        counts = {name: stage.rows(name) for name in names}
        quarantine = (
            self.job.sink(self.job.quarantine_sink).output if self.job.quarantine_sink else None
        )
        stats = {
            "rows_in": stage.rows(PARSED),
            "quarantined": counts.get(quarantine, 0) if quarantine else 0,
            "kept": stage.rows(KEPT),
            "outputs": counts,
        }
        stats["valid"] = stats["rows_in"] - stats["quarantined"]
        stats["duplicates"] = stats["valid"] - stats["kept"]
        stage.finish(stats)
        return staged, stats


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
