"""The Delta sink group: one Delta table of one job and everything onceflow does with it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from onceflow._delta_read import read_snapshot
from onceflow.errors import ConfigurationError, SinkError
from onceflow.sink_state import Expected, SinkState
from onceflow.sinks.base import (
    CommitRecord,
    ReconcileScope,
    RecordedWindow,
    SinkContext,
    SinkGroup,
    SinkOutcome,
    SinkReconcile,
    SinkSpec,
    TableFacts,
    WindowWrite,
)
from onceflow.sinks.delta import _records
from onceflow.sinks.delta._lineage import commits_after, window_commits, window_history
from onceflow.sinks.delta._log import commit_info, window_of
from onceflow.sinks.delta._reconcile import reconcile_sink
from onceflow.sinks.delta.spec import DeltaSink
from onceflow.sinks.delta.table import (
    META_PREFIX,
    DeltaCommit,
    DeltaTableSink,
    add_actions,
)
from onceflow.sinks.writers import spark_schema_to_arrow
from onceflow.storage import Location
from onceflow.windows import parse_interval

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow._ledger_scan import KnownWindows
    from onceflow.ledger import Window
    from onceflow.quality.target import Target
    from onceflow.sinks.maintenance import Hold, Options, TableMaintained

RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"
# Commit entries older than this are removed at a checkpoint, unless cleanup is off.
LOG_RETENTION_PROPERTY = "delta.logRetentionDuration"
LOG_RETENTION_DEFAULT = "interval 30 days"
LOG_CLEANUP_PROPERTY = "delta.enableExpiredLogCleanup"
# Commits looked at to find the newest window commit behind a run's epoch claims.
RECENT_COMMITS = 50
# Entries read past the kept commit records to find the oldest window commit only the log has.
LOG_HORIZON_WALK = 100


class DeltaGroup(SinkGroup):
    """One Delta sink: its table under the lake, committed once per window."""

    kind = "delta"
    fault_after_commit = "after_delta"

    @classmethod
    def open_groups(cls, specs: Sequence[SinkSpec], ctx: SinkContext) -> list[SinkGroup]:
        """Each Delta sink of a job is a group of its own (a table commits alone)."""
        return [cls(spec, ctx) for spec in specs if isinstance(spec, DeltaSink)]

    def __init__(self, spec: DeltaSink, ctx: SinkContext) -> None:
        self.spec = spec
        self.specs = (spec,)
        self.ctx = ctx
        self.table = DeltaTableSink(ctx.job.name, spec.name, ctx.settings.lake / spec.table)
        self.state = SinkState(ctx.ledger)
        # While `replay_lacking` puts windows back, a table restored from an older copy may
        # lack restatements too; reconcile's diff repairs those after the replay.
        self._replaying = False

    @property
    def _checked(self) -> bool:
        # Guarantee is a str enum; the module is not imported here (job imports the sinks).
        return self.ctx.job.guarantee == "exactly_once"

    def _expected(self, window_id: int) -> Expected:
        expected = self.state.expected(self.spec.name, window_id)
        if self._replaying:
            return Expected(expected.identity, expected.through, 0)
        return expected

    def _recorded_table(self) -> object | None:
        """The table if it is the one the ledger recorded (or none is recorded), else None."""
        if not self.table.exists():
            return None
        table = self.table.table()
        recorded = self.state.identity(self.spec.name)
        if recorded is not None and self.table.identity(table) != recorded:
            return None
        return table

    def prepare(self) -> None:
        # The table is created by the first commit, from the data's schema.
        return None

    def epoch_floor(self) -> int:
        return self.table.fenced_by()

    def claim_epoch(self, epoch: int) -> None:
        self.table.claim_epoch(epoch)

    def held(self, window_ids: Sequence[int]) -> dict[str, set[int]]:
        # Every commit checked that the table was the recorded one and held exactly the windows
        # the ledger expected before it: so the recorded table holds every expected window up
        # to its app transaction's version, and another table holds none of them.
        table = self._recorded_table()
        if table is None:
            return {self.spec.name: set()}
        through = table.transaction_version(self.table.app_id) or 0  # type: ignore[attr-defined]
        return {self.spec.name: {w for w in window_ids if w <= through}}

    def pinned(self) -> AbstractContextManager[None]:
        return self.table.pinned()

    def held_floor(self) -> int:
        # `held` answers "every window up to the app transaction's version" for the recorded
        # table, and none for another table.
        table = self._recorded_table()
        if table is None:
            return 0
        return table.transaction_version(self.table.app_id) or 0  # type: ignore[attr-defined]

    def state_problems(self) -> dict[str, str]:
        table = self._recorded_table()
        if table is None or not self._checked:
            return {}
        applied = table.transaction_version(self.table.restate_app) or 0  # type: ignore[attr-defined]
        through = table.transaction_version(self.table.app_id) or 0  # type: ignore[attr-defined]
        completed = self.state.restated_through()
        if through and applied < completed:
            return {
                self.spec.name: f"has applied restatements through {applied}, the ledger "
                f"completed restatements through {completed}"
            }
        return {}

    def prepare_replay(self) -> None:
        if not self.table.exists():
            self.state.forget_identity(self.spec.name)
        else:
            # The table as it stands is the one to make whole (reconcile diffs its rows).
            self.state.record_identity(self.spec.name, self.table.identity(self.table.table()))
        self._replaying = True

    def end_replay(self) -> None:
        self._replaying = False

    def committed_through(self) -> dict[str, int]:
        return {self.spec.name: self.table.committed_through()}

    def recorded_windows(self, after: int = 0) -> list[RecordedWindow]:
        if after > 0:
            return [
                RecordedWindow(
                    window,
                    json.loads(info[f"{META_PREFIX}offsets"]),
                    int(info[f"{META_PREFIX}epoch"]),
                )
                for window, info in commits_after(self.table, after)
                if f"{META_PREFIX}offsets" in info and f"{META_PREFIX}epoch" in info
            ]
        return [
            RecordedWindow(
                int(entry[f"{META_PREFIX}window_id"]),
                json.loads(entry[f"{META_PREFIX}offsets"]),
                int(entry[f"{META_PREFIX}epoch"]),
            )
            for entry in window_history(self.table)
        ]

    def commit_records(self, window_ids: Sequence[int]) -> dict[str, dict[int, CommitRecord]]:
        if self._recorded_table() is None:
            return {}
        records: dict[int, CommitRecord] = {}
        for window_id, (version, info) in window_commits(self.table, window_ids).items():
            rows = info.get(f"{META_PREFIX}rows")
            records[window_id] = CommitRecord(
                data_version=version, rows=int(rows) if rows is not None else None
            )
        return {self.spec.name: records}

    def restated_through(self) -> int:
        if not self.table.exists():
            return 0
        return self.table.table().transaction_version(self.table.restate_app) or 0

    def begin(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        sinks: Sequence[str],
        *,
        epoch: int,
        run_id: str,
    ) -> WindowWrite:
        if self.spec.name not in sinks:
            return WindowWrite([])
        schema = spark_schema_to_arrow(outputs[self.spec.output])
        if self._checked:
            expected = self._expected(window.window_id)
            identity = self.table.ensure_table(schema, expected)
            if expected.identity is None and identity is not None:
                self.state.record_identity(self.spec.name, identity)
        else:
            self.table.ensure_table(schema)
        writer = self.table.file_writer(
            self.spec.name, self.spec.output, schema, window.window_id, epoch
        )
        return WindowWrite([self.spec.name], [writer], time.monotonic())

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
        if not write.sinks:
            return {}
        commit = self.table.commit_files(
            add_actions([dict(r) for r in results[self.spec.name]]),
            window_id=window.window_id,
            epoch=epoch,
            run_id=run_id,
            offsets=window.offsets,
            exactly_once=exactly_once,
            expected=self._expected(window.window_id) if exactly_once else None,
        )
        return self._outcome(commit, write.state)

    def check_restate(self, window: Window) -> None:
        if self.table.committed_through() < window.window_id:
            raise SinkError(
                f"sink {self.spec.name}: window {window.window_id} is not committed yet; run the "
                "job first, then restate it."
            )
        names = {f.name for f in self.table.table().schema().fields}
        if "_window_id" not in names:
            raise SinkError(
                f"sink {self.spec.name}: its rows have no `_window_id` column, so a window's "
                "rows cannot be found to restate them; add it in the transform."
            )

    def restatement_applied(self, seq: int) -> set[str]:
        # The table records the highest restatement it applied, in one commit with its rows.
        table = self._recorded_table()
        if table is None:
            return set()
        applied = table.transaction_version(self.table.restate_app) or 0  # type: ignore[attr-defined]
        return {self.spec.name} if applied >= seq else set()

    def restate(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        *,
        epoch: int,
        run_id: str,
        seq: int,
    ) -> dict[str, SinkOutcome]:
        started = time.monotonic()
        commit = self.table.replace_window(
            outputs[self.spec.output],
            window_id=window.window_id,
            epoch=epoch,
            run_id=run_id,
            restate_seq=seq,
        )
        return self._outcome(commit, started)

    def _outcome(self, commit: DeltaCommit, started: float) -> dict[str, SinkOutcome]:
        return {
            self.spec.name: SinkOutcome(
                self.spec.name,
                committed=not commit.already_committed,
                already_committed=commit.already_committed,
                rows=commit.rows,
                data_version=commit.version,
                latency_s=time.monotonic() - started,
            )
        }

    def seen_keys(
        self,
        spark: SparkSession,
        sink: str,
        keys: Sequence[str],
        *,
        before: int | None = None,
        only: Sequence[int] | None = None,
    ) -> DataFrame | None:
        from pyspark.sql import functions as F

        if not self.table.exists():
            return None
        rows = read_snapshot(spark, self.table.table(), self.table.path)
        if "_window_id" not in rows.columns:
            raise ConfigurationError(
                f"sink {self.spec.name} holds the job's dedupe state, but its rows have no "
                "`_window_id` column; add it in the transform (the window's id, from ctx)."
            )
        if before is not None:
            rows = rows.where(F.col("_window_id") < before)
        if only is not None:
            rows = rows.where(F.col("_window_id").isin(sorted(only)))
        return rows.groupBy(*keys).agg(F.min("_window_id").alias("__seen_in"))

    def reconcile_since(self, sink: str, verified: int) -> int:
        # Rows carry their window: those of windows after `verified` compare on their own.
        if verified <= 0 or not self.table.exists():
            return 0
        names = {f.name for f in self.table.table().schema().fields}
        return verified if "_window_id" in names else 0

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
        return reconcile_sink(
            self.table, self.state, spark, sink, expected, scope,
            epoch=epoch, run_id=run_id, workdir=workdir,
        )  # fmt: skip

    def unrecorded(self, known: KnownWindows) -> str | None:
        """Why the table's log may not name windows it holds beyond `known` (None if it does).

        The table's app transaction says which windows it holds (checkpoints keep it); each
        window's offsets are only in its commit entry, which log cleanup removes. Without them
        a rebuilt ledger would not know that input was taken and would plan it again.
        """
        if not self.table.exists():
            return None
        through = self.table.table().transaction_version(self.table.app_id) or 0
        missing = known.missing(through)
        if not missing or self.table.first_entry() is not None or _records.whole(self.table):
            return None
        from onceflow.windows import format_windows

        return (
            f"sink {self.spec.name}: Delta table {self.table.path} holds windows "
            f"{format_windows(missing)}, which the ledger lacks, and its log no longer has "
            f"their commit entries (a checkpoint cleaned up entries older than "
            f"{LOG_RETENTION_PROPERTY}), so the input they took cannot be told from new input. "
            "Restore the PostgreSQL `onceflow` schema from a backup and run again; or start the "
            "job over: move its Delta tables away (and empty its other sinks), then run it, "
            "and every input is planned again into new tables."
        )

    def check_retention(
        self, oldest_window: datetime | None, *, records_elsewhere: bool = False
    ) -> None:
        """Refuse when the table may forget records that recovery needs before the oldest window.

        A checkpoint drops application transactions older than
        `delta.setTransactionRetentionDuration` (a sink that forgot them looks as if it held no
        window, and a replay would write committed windows again), and removes commit entries
        older than `delta.logRetentionDuration` (30 days unless set; the windows' offsets a lost
        ledger is rebuilt from) unless `delta.enableExpiredLogCleanup` is false. The horizon
        is the age of the job's oldest window, taken from the ledger and from the table's
        creation time (kept in every checkpoint), never from log entries that may be gone.

        Args:
            oldest_window: When the ledger's oldest window was planned (None: no windows).
            records_elsewhere: Another sink group of the job keeps every window's record for
                good (PostgreSQL markers), so the log is not needed to rebuild the ledger.
        """
        if not self.table.exists():
            return
        table = self.table.table()
        metadata = table.metadata()
        config = metadata.configuration
        oldest = oldest_window
        created = _created_at(metadata.created_time, self.table.first_entry())
        if created is not None:
            oldest = created if oldest is None else min(oldest, created)
        if oldest is None:
            return
        horizon = datetime.now(timezone.utc) - oldest
        fix = "(DeltaTable(...).alter.set_table_properties)"
        txn = config.get(RETENTION_PROPERTY)
        if txn is not None and parse_interval(txn) < horizon:
            raise ConfigurationError(
                f"Delta table {self.table.path} sets {RETENTION_PROPERTY} = {txn!r}, shorter "
                f"than the job's replay horizon ({horizon.days} day(s), the age of its oldest "
                "window): the table may forget which windows it holds, and a replay would write "
                f"them again. Remove the property or set it longer than the horizon {fix}."
            )
        cleanup = str(config.get(LOG_CLEANUP_PROPERTY, "true")).strip().lower() != "false"
        log = config.get(LOG_RETENTION_PROPERTY, LOG_RETENTION_DEFAULT)
        unkept = self._log_horizon(horizon) if cleanup and not records_elsewhere else None
        if unkept is not None and parse_interval(log) < unkept:
            raise ConfigurationError(
                f"Delta table {self.table.path} keeps commit entries for {LOG_RETENTION_PROPERTY}"
                f" = {log!r}{'' if LOG_RETENTION_PROPERTY in config else ' (the default)'}, "
                f"shorter than the job's replay horizon ({unkept.days} day(s), the age of its "
                "oldest window whose record is only in the log): a checkpoint removes older "
                "entries, and with them the offsets of the windows they committed, which the job "
                "has nowhere else (its only sinks are Delta tables, and `onceflow maintain` has "
                "not kept their records beside the log), so a lost ledger could not be rebuilt. "
                "Run `onceflow maintain` (it keeps them), set "
                f"{LOG_RETENTION_PROPERTY} longer than the job will live (e.g. 'interval 3650 "
                f"days') or {LOG_CLEANUP_PROPERTY} = 'false' {fix}, or give the job a "
                "PostgreSQL sink."
            )

    def keep_log_records(self) -> None:
        """Keep the commit records of every log entry beside the log (`_records`), so log
        cleanup never takes a window's only record."""
        if self.table.exists():
            _records.summarize(self.table, self.table.table().version())

    def _log_horizon(self, horizon: timedelta) -> timedelta:
        """How old the oldest window commit is whose record is only in the log: the first
        after the records `onceflow maintain` keeps beside the log (`_records`), else the
        job's horizon. Entries of no window (a run's epoch claim) are passed over."""
        through = _records.covered_through(self.table)
        if through < 0:
            return horizon
        newest = self.table.table().version()
        first: dict[str, Any] | None = None
        for version in range(through + 1, min(newest, through + LOG_HORIZON_WALK) + 1):
            actions = self.table.entry_actions(version)
            if actions is None:
                return horizon  # gone too: the records cannot vouch for it
            info = commit_info(actions)
            first = first or info
            if window_of(actions, self.table.app_id) is not None:
                return min(horizon, _age(info))
        if newest - through > LOG_HORIZON_WALK:
            return min(horizon, _age(first or {}))  # a long run of entries: the oldest counts
        return timedelta(0)

    def maintain(
        self,
        holds: Callable[[Location], list[Hold]],
        *,
        fence: Callable[[], int],
        options: Options,
        log_is_only_record: bool,
    ) -> list[TableMaintained]:
        """Compact, checkpoint, vacuum and clean the log of the table, past `holds(path)`
        (`onceflow.sinks.delta._maintain`); nothing for a table not created yet."""
        from onceflow.sinks.delta._maintain import maintain_table

        if not self.table.exists():
            return []
        return [
            maintain_table(
                self.table,
                holds(self.table.path),
                log_is_only_record=log_is_only_record,
                fence=fence,
                options=options,
            )
        ]

    def data_version(self, sink: str) -> int | None:
        """The version holding the newest window commit (epoch claims move the table's version
        without moving its data)."""
        if not self.table.exists():
            return None
        table = self.table.table()
        for entry in table.history(limit=RECENT_COMMITS):
            if entry.get(f"{META_PREFIX}window_id") is not None and "version" in entry:
                return int(entry["version"])
        return int(table.version())

    def table_facts(self, sink: str) -> TableFacts:
        uri = self.table.path.as_uri()
        if not self.table.exists():
            return TableFacts(uri, (), None)
        import pyarrow as pa
        import pyarrow.compute as pc

        table = self.table.table()
        columns = tuple(
            (f.name, str(getattr(f.type, "type", f.type))) for f in table.schema().fields
        )
        files = pa.table(table.get_add_actions(flatten=True))
        rows = pc.sum(files.column("num_records")).as_py() if files.num_rows else 0
        return TableFacts(uri, columns, int(rows or 0))

    def quality_targets(self) -> list[Target]:
        from onceflow._identifiers import delta_app_id
        from onceflow.sinks.delta._quality import DeltaTableTarget

        job = self.ctx.job
        key = job.dedupe.key if job.dedupe else ()
        if not key:
            return []
        regex: dict[str, str] = dict(job.metadata.get("regex", {}))
        return [
            DeltaTableTarget(
                sink=self.spec.name,
                path=str(self.table.path),
                key=key,
                expected_output=self.spec.output,
                app_id=delta_app_id(job.name, self.spec.name),
                not_null=key,
                regex=regex,
            )
        ]

    def status(self) -> dict[str, dict[str, Any]]:
        return {
            self.spec.name: {
                "kind": self.kind,
                "table": str(self.table.path),
                "committed_through": self.table.committed_through(),
            }
        }


def _age(info: Mapping[str, Any]) -> timedelta:
    """How long ago a commit was made (its info's timestamp); an unknown time counts as old."""
    millis = info.get("inCommitTimestamp") or info.get("timestamp")
    if not isinstance(millis, int | float):
        return timedelta.max
    return datetime.now(timezone.utc) - datetime.fromtimestamp(millis / 1000, timezone.utc)


def _created_at(created_ms: int | None, first: Mapping[str, Any] | None) -> datetime | None:
    """When the table was created: its metadata's creation time, else its first commit's."""
    millis = created_ms
    if millis is None and first is not None:
        millis = first.get("inCommitTimestamp") or first.get("timestamp")
    if not isinstance(millis, int | float) or millis <= 0:
        return None
    return datetime.fromtimestamp(millis / 1000, timezone.utc)
