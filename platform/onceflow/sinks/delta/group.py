"""The Delta sink group: one Delta table of one job and everything onceflow does with it."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from onceflow._delta_read import read_snapshot, spark_schema
from onceflow.errors import ConfigurationError, SinkError
from onceflow.sink_state import Expected, SinkState
from onceflow.sinks.base import (
    ReconcileScope,
    RecordedWindow,
    SinkContext,
    SinkGroup,
    SinkOutcome,
    SinkReconcile,
    TableFacts,
    WindowWrite,
)
from onceflow.sinks.delta._reconcile import reconcile_delta
from onceflow.sinks.delta.spec import DeltaSink
from onceflow.sinks.delta.table import (
    META_PREFIX,
    DeltaCommit,
    DeltaTableSink,
    add_actions,
    spark_schema_to_arrow,
)
from onceflow.storage import Location
from onceflow.windows import WINDOW_COL, parse_interval

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.ledger import Window
    from onceflow.quality import Target

RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"
# Commits looked at to find the newest window commit behind a run's epoch claims.
RECENT_COMMITS = 50


class DeltaGroup(SinkGroup):
    """One Delta sink: its table under the lake, committed once per window."""

    kind = "delta"

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

    def recorded_windows(self) -> list[RecordedWindow]:
        return [
            RecordedWindow(
                int(entry[f"{META_PREFIX}window_id"]),
                json.loads(entry[f"{META_PREFIX}offsets"]),
                int(entry[f"{META_PREFIX}epoch"]),
            )
            for entry in self.table.history()
        ]

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
                delta_version=commit.version,
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
        from pyspark.sql import functions as F

        if not self.table.exists():
            return SinkReconcile(
                None, "the Delta table does not exist yet", frozenset(), frozenset()
            )
        table = self.table.table()
        through = table.transaction_version(self.table.app_id) or 0
        committed = frozenset(w for w in scope.windows if w <= through)
        schema = spark_schema(table)
        columns = [f.name for f in schema.fields]  # type: ignore[attr-defined]
        window_col = "_window_id" if "_window_id" in columns else None
        if window_col is None and scope.unverifiable:
            return SinkReconcile(None, "holds rows of unverifiable windows", committed, frozenset())
        since = scope.since if window_col else 0
        compare = frozenset(w for w in committed if w > since and w not in scope.unverifiable)
        if expected is None:
            expected = spark.createDataFrame([], schema).withColumn(  # type: ignore[arg-type]
                WINDOW_COL, F.lit(None).cast("bigint")
            )
        expected = expected.where(
            F.col(WINDOW_COL).isin(sorted(compare)) if compare else F.lit(False)
        ).select(*[F.col(f.name).cast(f.dataType) for f in schema.fields])  # type: ignore[attr-defined]

        def prepare_actual(actual: DataFrame) -> DataFrame:
            if window_col is None:
                return actual
            column = F.col(window_col)
            keep = column > since
            if scope.unverifiable:
                keep = keep & ~column.isin(sorted(scope.unverifiable))
            return actual.where(column.isNull() | keep)

        diff = reconcile_delta(
            spark,
            self.table,
            table,
            expected,
            prepare_actual=prepare_actual,
            workdir=workdir,
            epoch=epoch,
            run_id=run_id,
        )
        if epoch is not None and window_col is not None and not scope.unverifiable:
            # Its rows now are what every restatement made them: record them as applied.
            self.table.record_restated(self.state.restated_through(), epoch)
        return SinkReconcile(
            diff,
            None,
            committed,
            compare if window_col else frozenset(),
            tuple(diff.samples(window_col, keyed=False)),
        )

    def check_retention(self, oldest_window: datetime | None) -> None:
        """Refuse when the table may forget its window records before the oldest window.

        A Delta table drops application transactions older than its
        `delta.setTransactionRetentionDuration` when it checkpoints; a sink that forgot them
        looks as if it held no window, and a replay would write committed windows again.
        """
        if not self.table.exists():
            return
        value = self.table.table().metadata().configuration.get(RETENTION_PROPERTY)
        if value is None:
            return
        oldest = oldest_window
        for entry in self.table.history():
            committed = datetime.fromtimestamp(int(entry["timestamp"]) / 1000, timezone.utc)
            oldest = committed if oldest is None else min(oldest, committed)
            break  # history() is in window order: the first entry is the oldest window
        if oldest is None:
            return
        horizon = datetime.now(timezone.utc) - oldest
        retention = parse_interval(value)
        if retention < horizon:
            raise ConfigurationError(
                f"Delta table {self.table.path} sets {RETENTION_PROPERTY} = {value!r}, shorter "
                f"than the job's replay horizon ({horizon.days} day(s), the age of its oldest "
                "window): the table may forget which windows it holds, and a replay would write "
                "them again. Remove the property or set it longer than the horizon "
                "(DeltaTable(...).alter.set_table_properties)."
            )

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
        from onceflow.quality import DeltaTableTarget

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
