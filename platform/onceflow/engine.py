"""The engine: plans windows ahead, computes them once, and commits them to every sink once."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onceflow import faults
from onceflow._staging import Contributions, WindowStage
from onceflow.errors import LedgerError
from onceflow.job import DeltaSink, Guarantee, Job, PostgresSink, WindowContext
from onceflow.ledger import Ledger, Window
from onceflow.settings import Settings
from onceflow.sinks.delta import DeltaTableSink, read_delta
from onceflow.sinks.postgres import PostgresTableSink

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_log = logging.getLogger(__name__)

DEFAULT_MAX_FILES_PER_WINDOW = 1000


@dataclass
class SinkOutcome:
    """What one sink did with one window."""

    sink: str
    committed: bool  # this run wrote the window
    already_committed: bool  # the sink held it before
    rows: int = 0
    delta_version: int | None = None
    xid: str | None = None
    latency_s: float = 0.0


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


class Engine:
    """Runs one job against one set of settings, on one Spark session."""

    def __init__(
        self,
        job: Job,
        settings: Settings,
        spark: SparkSession,
        dsn: str,
        *,
        guarantee: Guarantee | str | None = None,
    ) -> None:
        self.job = job.with_guarantee(guarantee) if guarantee else job
        self.settings = settings
        self.spark = spark
        self.dsn = dsn
        self.ledger = Ledger(dsn, job.name)
        self.delta: dict[str, DeltaTableSink] = {}
        self.postgres: dict[str, PostgresTableSink] = {}
        for sink in self.job.sinks:
            if isinstance(sink, DeltaSink):
                self.delta[sink.name] = DeltaTableSink(
                    job.name, sink.name, settings.lake / sink.table
                )
            else:
                self.postgres[sink.name] = PostgresTableSink(job.name, sink, dsn, self.ledger)
        self._prepared = False

    @property
    def exactly_once(self) -> bool:
        return self.job.guarantee is Guarantee.EXACTLY_ONCE

    # -- set-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the ledger and the PostgreSQL tables; rebuild the ledger from the sinks."""
        if self._prepared:
            return
        self.ledger.ensure_schema()
        for sink in self.postgres.values():
            sink.ensure_table()
        self._prepared = True

    def sink_epoch_floor(self) -> int:
        """The highest epoch any sink has seen, so a new epoch is higher even without a ledger."""
        floor = 0
        for sink in self.delta.values():
            floor = max(floor, sink.fenced_by())
        with self.ledger.connect() as conn:
            row = conn.execute(
                "SELECT coalesce(max(epoch), 0) FROM onceflow.sink_commits WHERE job = %s",
                (self.job.name,),
            ).fetchone()
            floor = max(floor, int(row[0]) if row else 0)
        return floor

    def rebuild_ledger(self) -> list[int]:
        """Put back windows the sinks recorded but the ledger lost; return their ids."""
        known = {w.window_id for w in self.ledger.windows()}
        found: dict[int, Window] = {}
        for sink in self.delta.values():
            for entry in sink.history():
                wid = int(entry["onceflow.window_id"])
                if wid not in known and wid not in found:
                    import json

                    found[wid] = Window(
                        self.job.name,
                        wid,
                        json.loads(entry["onceflow.offsets"]),
                        int(entry["onceflow.epoch"]),
                    )
        for name in self.postgres:
            for wid, marker in self.ledger.markers(name).items():
                if wid not in known and wid not in found:
                    found[wid] = Window(self.job.name, wid, marker["offsets"], int(marker["epoch"]))
        for wid in sorted(found):
            window = found[wid]
            self.ledger.restore_window(window, window.offsets.get("files", []))
        # The file index can be lost on its own; without it, planned files would be planned
        # again as new windows.
        self.ledger.restore_source_files()
        if found:
            _log.warning("job %s: rebuilt %d window(s) from the sinks", self.job.name, len(found))
        return sorted(found)

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        *,
        max_files_per_window: int | None = None,
        run_id: str | None = None,
        follow: bool = False,
        poll_interval_s: float = 1.0,
        stop: threading.Event | None = None,
        on_window: Callable[[WindowResult], None] | None = None,
        max_windows: int | None = None,
    ) -> RunResult:
        """Replay pending windows, then plan and commit windows for all visible new input.

        Args:
            max_files_per_window: Most files a new window takes (default 1000).
            run_id: An id for this run, recorded with every commit.
            follow: Keep running and commit new files as they land, until `stop` is set.
            poll_interval_s: How often `follow` looks for new files.
            stop: Set it to end a `follow` run after the current window.
            on_window: Called after each window.
            max_windows: Plan at most this many new windows.
        """
        from onceflow.reconcile import check_replay_horizon

        self.prepare()
        self.rebuild_ledger()
        check_replay_horizon(self)
        run_id = run_id or uuid.uuid4().hex
        epoch = self.ledger.acquire_epoch(run_id, floor=self.sink_epoch_floor())
        for sink in self.delta.values():
            if sink.exists():
                sink.claim_epoch(epoch)
        result = RunResult(self.job.name, run_id, epoch)

        def done(window_result: WindowResult) -> None:
            result.windows.append(window_result)
            if on_window:
                on_window(window_result)

        for window in self.ledger.windows(pending_only=True):
            done(self.process_window(window, epoch, run_id))
        stop = stop or threading.Event()
        planned = 0
        while max_windows is None or planned < max_windows:
            for window in self._plan_new(epoch, max_files_per_window):
                done(self.process_window(window, epoch, run_id))
                planned += 1
                if stop.is_set() or (max_windows is not None and planned >= max_windows):
                    break
            if not follow or stop.is_set() or (max_windows is not None and planned >= max_windows):
                break
            stop.wait(poll_interval_s)
        return result

    def _plan_new(self, epoch: int, max_files: int | None) -> Any:
        """Plan windows over visible unplanned files, yielding each as soon as it is planned."""
        root = self.settings.landing
        files = self.ledger.unplanned(self.job.source.discover(root))
        size = max_files or DEFAULT_MAX_FILES_PER_WINDOW
        for start in range(0, len(files), size):
            chunk = files[start : start + size]
            window = self.ledger.plan_window(epoch, self.job.source.offsets(root, chunk), chunk)
            if self.job.guarantee is Guarantee.NONE:
                self.ledger.mark_completed(window.window_id)
            yield window

    def commit_state(self, window_ids: Sequence[int] | None = None) -> dict[int, set[str]]:
        """For each window (default: every planned one), the sinks that hold it.

        One look at each Delta table and one query per PostgreSQL sink, whatever the number
        of windows.
        """
        if window_ids is None:
            window_ids = [w.window_id for w in self.ledger.windows()]
        through = {name: s.committed_through() for name, s in self.delta.items()}
        state = {wid: {n for n, t in through.items() if t >= wid} for wid in window_ids}
        for name in self.postgres:
            for wid in self.ledger.markers(name, list(window_ids)):
                state[wid].add(name)
        return state

    def restate_window(
        self, window_id: int, run_id: str, request_id: str | None = None
    ) -> WindowResult:
        """Replace `window_id`'s effect in every sink (see `onceflow.restate`)."""
        from onceflow.restate import restate_window

        return restate_window(self, window_id, run_id=run_id, request_id=request_id)

    def committed_sinks(self, window_id: int) -> set[str]:
        """The sinks that hold `window_id`."""
        held = {name for name, s in self.delta.items() if s.committed_through() >= window_id}
        for name in self.postgres:
            if window_id in self.ledger.markers(name, [window_id]):
                held.add(name)
        return held

    def process_window(self, window: Window, epoch: int, run_id: str) -> WindowResult:
        """Commit `window` to every sink that does not hold it yet."""
        started = time.monotonic()
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        held = self.committed_sinks(window.window_id) if self.exactly_once else set()
        result = WindowResult(window.window_id, window.offsets, window.stats or {})
        for name in held:
            result.sinks[name] = SinkOutcome(name, committed=False, already_committed=True)
        todo = [s for s in self.job.sinks if s.name not in held]
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
        for sink in [s for s in todo if isinstance(s, DeltaSink)]:
            result.sinks[sink.name] = self._commit(
                sink, outputs[sink.output], window, epoch, run_id
            )
        faults.point("after_delta", window.window_id)
        stage = WindowStage(self.settings.lake, self.job.name, window.window_id)
        for sink in self.job.sinks:
            if isinstance(sink, PostgresSink) and sink.mode == "accumulate":
                self.contributions(sink.name).save(window.window_id, stage.root / sink.output)
        for sink in [s for s in todo if isinstance(s, PostgresSink)]:
            result.sinks[sink.name] = self._commit(
                sink, outputs[sink.output], window, epoch, run_id
            )
        faults.point("after_commits", window.window_id)
        if self.exactly_once:
            self.ledger.check_epoch(epoch)
        self.ledger.mark_completed(window.window_id)
        stage.discard()
        result.latency_s = time.monotonic() - started
        return result

    def _commit(
        self, sink: DeltaSink | PostgresSink, df: DataFrame, window: Window, epoch: int, run_id: str
    ) -> SinkOutcome:
        started = time.monotonic()
        target = self.delta[sink.name] if isinstance(sink, DeltaSink) else self.postgres[sink.name]
        commit = target.commit_window(
            df, window_id=window.window_id, epoch=epoch, run_id=run_id, offsets=window.offsets,
            exactly_once=self.exactly_once,
        )  # fmt: skip
        return SinkOutcome(
            sink.name,
            committed=not commit.already_committed,
            already_committed=commit.already_committed,
            rows=commit.rows,
            delta_version=getattr(commit, "version", None),
            xid=getattr(commit, "xid", None),
            latency_s=time.monotonic() - started,
        )

    def contributions(self, sink: str) -> Contributions:
        """Where an accumulating sink's per-window contributions are kept."""
        return Contributions(self.settings.lake, self.job.name, sink)

    # -- computing ----------------------------------------------------------------------------

    def outputs(
        self, window: Window, *, use_stage: bool = True, stage_tag: str = ""
    ) -> tuple[dict[str, DataFrame], dict[str, Any]]:
        """The window's outputs, staged once so every sink and every retry sees the same rows."""
        stage = WindowStage(self.settings.lake, self.job.name, window.window_id, stage_tag)
        names = {s.output for s in self.job.sinks}
        stats = stage.complete() if use_stage else None
        if stats is not None:
            return {name: stage.read(self.spark, name) for name in names}, stats
        outputs = self.compute(window, stage_tag=stage_tag)
        staged = {name: stage.write(name, outputs[name]) for name in names}
        counts = {name: stage.rows(name) for name in names}
        stats = {
            "rows_in": stage.rows("_parsed"),
            "quarantined": counts.get("quarantine", 0),
            "kept": stage.rows("_kept"),
            "outputs": counts,
        }
        stats["valid"] = stats["rows_in"] - stats["quarantined"]
        stats["duplicates"] = stats["valid"] - stats["kept"]
        stage.finish(stats)
        return staged, stats

    def compute(self, window: Window, *, stage_tag: str = "") -> Mapping[str, DataFrame]:
        """Run the source, parse, dedupe and transform for `window` (lazy, except staging)."""
        from pyspark.sql import Window as W
        from pyspark.sql import functions as F

        job = self.job
        stage = WindowStage(self.settings.lake, job.name, window.window_id, stage_tag)
        raw = job.source.read(self.spark, self.settings.landing, window.offsets)
        parsed = stage.write("_parsed", job.parse(raw))
        valid = parsed.where(F.col("_reason").isNull())
        invalid = parsed.where(F.col("_reason").isNotNull())
        if job.dedupe is not None:
            keys = list(job.dedupe.key)
            first = W.partitionBy(*keys).orderBy("_file_idx", "_source_line")
            valid = (
                valid.withColumn("_occurrence", F.row_number().over(first))
                .where(F.col("_occurrence") == 1)
                .drop("_occurrence")
            )
            seen = self._seen_keys(window.window_id, keys)
            if seen is not None:
                valid = valid.join(seen, on=keys, how="left_anti")
        kept = stage.write("_kept", valid)
        outputs = dict(job.transform(kept, WindowContext(job.name, window.window_id)))
        if job.quarantine_sink is not None:
            outputs[job.sink(job.quarantine_sink).output] = invalid.select(
                F.lit(job.name).alias("job"),
                F.lit(window.window_id).cast("bigint").alias("window_id"),
                F.col("_source_file").alias("source_file"),
                F.col("_source_line").alias("source_line"),
                F.col("_raw_text").alias("raw_line"),
                F.col("_reason").alias("reason"),
            )
        return outputs

    def _seen_keys(self, window_id: int, keys: list[str]) -> DataFrame | None:
        from pyspark.sql import functions as F

        assert self.job.dedupe is not None
        state = self.delta[self.job.dedupe.state_sink]
        if not state.exists():
            return None
        if self.exactly_once and state.committed_through() < window_id - 1:
            raise LedgerError(
                f"job {self.job.name}: dedupe state {state.sink} holds windows up to "
                f"{state.committed_through()}, but window {window_id} needs all before it. "
                "Run reconcile."
            )
        return (
            read_delta(self.spark, state.path)
            .where(F.col("_window_id") < window_id)
            .select(*keys)
            .distinct()
        )


def build_engine(
    job: Job,
    settings: Settings,
    spark: SparkSession,
    dsn: str,
    guarantee: Guarantee | str | None = None,
) -> Engine:
    """Make an engine after checking the settings' folders."""
    settings.check_folders()
    return Engine(job, settings, spark, dsn, guarantee=guarantee)


def lake_path(settings: Settings, sink: DeltaSink) -> Path:
    return settings.lake / sink.table
