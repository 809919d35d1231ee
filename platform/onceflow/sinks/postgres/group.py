"""The PostgreSQL sink group: every PostgreSQL sink of one job, committed in one transaction."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg import sql
from psycopg.rows import tuple_row

from onceflow import faults
from onceflow._pgcopy import CopyWriter
from onceflow.errors import SinkError, TransientSinkError
from onceflow.job import Guarantee
from onceflow.postgres import (
    RETRY_ENV,
    connect,
    database_uri,
    retry_deadline_s,
    retry_delays,
    retrying,
)
from onceflow.sink_state import SinkState
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
from onceflow.sinks.postgres import _compare, _folded, _held
from onceflow.sinks.postgres._accumulate import forget_contributions, has_contribution
from onceflow.sinks.postgres._columns import count_rows, create_table, table_problems
from onceflow.sinks.postgres._markers import create_protocol_tables, marker_xids
from onceflow.sinks.postgres._quality import quality_targets
from onceflow.sinks.postgres.commit import Applied, Staged, Transaction
from onceflow.sinks.postgres.spec import PostgresSink
from onceflow.sinks.writers import rows_written
from onceflow.storage import Location

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.ledger import Window
    from onceflow.quality.target import Target

_log = logging.getLogger(__name__)


T = TypeVar("T")


class PostgresGroup(SinkGroup):
    """The PostgreSQL sinks of one job: one transaction per window, one marker per sink."""

    kind = "postgres"
    fault_after_commit = "after_postgres"
    keeps_window_records = True  # markers are rows

    @classmethod
    def open_groups(cls, specs: Sequence[SinkSpec], ctx: SinkContext) -> list[SinkGroup]:
        """A job's PostgreSQL sinks are one group: one transaction commits a window to all."""
        mine = tuple(spec for spec in specs if isinstance(spec, PostgresSink))
        return [cls(mine, ctx)] if mine else []

    def __init__(self, specs: tuple[PostgresSink, ...], ctx: SinkContext) -> None:
        self.specs = specs
        self.by_name = {s.name: s for s in specs}
        self.ctx = ctx
        self.job = ctx.job.name
        self._tx = Transaction(self.job, ctx.dsn, ctx.ledger)
        self.state = SinkState(ctx.ledger)
        self._verified: _held.HeldPoints | None = None  # the last `held_floor` read

    @property
    def _exactly_once(self) -> bool:
        return self.ctx.job.guarantee is Guarantee.EXACTLY_ONCE

    # Reads and the idempotent DDL are done again after a lost connection; the commit itself
    # is decided by its markers (`Transaction`).

    def _read(self, what: str, query: Callable[[Any], T]) -> T:
        def attempt() -> T:
            with self.ctx.ledger.sessions.session(autocommit=True) as conn:
                return query(conn)

        return retrying(attempt, what=f"{what} (job {self.job})", dsn=self.ctx.dsn)

    # -- set-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        def create() -> None:
            with connect(self.ctx.dsn) as conn:
                # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog; serialise.
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
                create_protocol_tables(conn)
                for spec in self.specs:
                    create_table(conn, spec)
                conn.commit()

        retrying(create, what=f"create the tables of job {self.job}", dsn=self.ctx.dsn)
        # A table's identity is its oid: one dropped and created again (by the `CREATE TABLE
        # IF NOT EXISTS` above, or by hand) is another table, and its markers do not hold.
        current = self._oids()
        for name, identity in self._recorded().items():
            if identity is None and current.get(name):
                self.state.record_identity(name, current[name])

    def check_tables(self) -> None:
        problems = self._read(
            "check the sink tables' columns",
            lambda conn: [p for spec in self.specs for p in table_problems(conn, spec)],
        )
        if problems:
            raise SinkError(
                f"job {self.job}: a sink table does not fit the job's declaration: "
                f"{'; '.join(problems)}. Nothing was computed or written; change the table "
                "(or the sink's `columns`) and run the job again."
            )

    def _oids(self) -> dict[str, str | None]:
        """The oid of each sink's table now (None if missing)."""

        def read(conn: Any) -> dict[str, str | None]:
            out: dict[str, str | None] = {}
            for spec in self.specs:
                row = conn.execute(
                    "SELECT to_regclass(%s)::oid::text",
                    (sql.Identifier(spec.schema, spec.table).as_string(conn),),
                ).fetchone()
                out[spec.name] = row[0] if row else None
            return out

        return self._read("read the sink tables' oids", read)

    def _recorded(self) -> dict[str, str | None]:
        return self.state.identities(list(self.by_name))

    def _replaced(self) -> set[str]:
        """Sinks whose table is not the one recorded (dropped, created again)."""
        current = self._oids()
        return {
            name
            for name, identity in self._recorded().items()
            if identity is not None and current.get(name) != identity
        }

    def prepare_replay(self) -> None:
        replaced = self._replaced()
        if not replaced:
            return
        current = self._oids()

        def forget(conn: Any) -> None:
            # The markers and contributions of a table that is gone describe nothing now; the
            # windows are put back into the table there is, through the commit protocol.
            for table in (
                "sink_commits",
                "sink_commits_folded",
                "restate_commits",
                "window_contributions",
            ):
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE job = %s AND sink = ANY(%s)").format(
                        sql.Identifier("onceflow", table)
                    ),
                    (self.job, sorted(replaced)),
                )

        self.ctx.ledger.write("forget the markers of replaced sink tables", forget)
        for name in replaced:
            if current.get(name):
                self.state.record_identity(name, current[name])  # type: ignore[arg-type]
            else:
                self.state.forget_identity(name)

    def epoch_floor(self) -> int:
        row = self._read(
            "read the sinks' highest epoch",
            lambda conn: conn.execute(
                "SELECT greatest((SELECT max(epoch) FROM onceflow.sink_commits WHERE job = %s),"
                " (SELECT max(max_epoch) FROM onceflow.sink_commits_folded WHERE job = %s), 0)",
                (self.job, self.job),
            ).fetchone(),
        )
        return int(row[0]) if row else 0

    def _summary(self, what: str) -> dict[str, tuple[int, int]]:
        """Per sink: the windows its markers (folded or not) hold, and the last one."""
        rows = self._read(
            what,
            lambda conn: conn.execute(
                _folded.SUMMARY, {"job": self.job, "sinks": list(self.by_name)}
            ).fetchall(),
        )
        return {str(s): (int(n), int(w)) for s, n, w, _ in rows}

    def claim_epoch(self, epoch: int) -> None:
        # PostgreSQL sinks are fenced by the ledger's job row, which the new epoch has taken.
        return None

    # -- commit records -----------------------------------------------------------------------

    def _markers(self, after: int = 0) -> list[tuple[Any, ...]]:
        """(sink, window, epoch, offsets) of every marker above `after`, the folded ones too."""
        sinks = list(self.by_name)

        def read(conn: Any) -> list[tuple[Any, ...]]:
            # The rows before the folded ones: a fold committing in between makes a window
            # read twice, never missed.
            with conn.cursor(row_factory=tuple_row) as cur:
                rows = cur.execute(
                    "SELECT sink, window_id, epoch, offsets FROM onceflow.sink_commits"
                    " WHERE job = %s AND sink = ANY(%s) AND window_id > %s",
                    (self.job, sinks, after),
                ).fetchall()
            folded = _folded.folded_records(conn, self.job, sinks, after)
            return rows + [(s, m["window"], m["epoch"], m["offsets"]) for s, m in folded]

        return self._read("read the commit markers", read)

    def held(self, window_ids: Sequence[int]) -> dict[str, set[int]]:
        # Only the pairs without a marker come back: a year of windows that every sink holds
        # is one index probe each on the server and an empty answer.
        replaced = self._replaced()
        ids = sorted(set(window_ids))
        held: dict[str, set[int]] = {
            name: set() if name in replaced else set(ids) for name in self.by_name
        }
        sinks = sorted(set(self.by_name) - replaced)
        rows = self._read(
            "read which windows the sinks lack",
            lambda conn: _folded.lacking(conn, self.job, sinks, ids),
        )
        for sink, wid in rows:
            held[str(sink)].discard(int(wid))
        return held

    def held_floor(self) -> int:
        # The point the last passed check verified, while the markers through it are as they
        # were and no table was replaced (`_held`).
        sinks = list(self.by_name)
        self._verified = (
            None
            if self._replaced()
            else self._read(
                "read the sinks' verified point", lambda conn: _held.floor(conn, self.job, sinks)
            )
        )
        return self._verified.through if self._verified else 0

    def held_mark(self, through: int) -> Any:
        sinks, verified = list(self.by_name), self._verified
        if verified is not None and through >= verified.through:
            # The counts through the floor were just taken (`held_floor`): add the ones above.
            return self._read(
                "count the newer commit markers",
                lambda conn: verified.count_from(conn, self.job, through),
            )
        return self._read(
            "count the commit markers",
            lambda conn: _held.marker_counts(conn, self.job, sinks, through),
        )

    def record_held(self, through: int, mark: Any) -> None:
        self.ctx.ledger.write(
            "record the sinks' verified point",
            lambda conn: _held.record(conn, self.job, through, mark),
        )

    def committed_through(self) -> dict[str, int]:
        through = {name: 0 for name in self.by_name}
        summary = self._summary("read the last committed windows")
        through.update({s: w for s, (_, w) in summary.items()})
        return through

    def recorded_windows(self, after: int = 0) -> list[RecordedWindow]:
        return [RecordedWindow(int(w), o, int(e)) for _, w, e, o in self._markers(after)]

    def commit_records(self, window_ids: Sequence[int]) -> dict[str, dict[int, CommitRecord]]:
        # The marker was written by the transaction that committed the window: its xid is the
        # xmin of the window's rows. Its rows_written counts rows added (an upsert's or an
        # accumulation's differ from rows written), so no row count is given.
        sinks = list(self.by_name)
        rows = self._read(
            "read the commit markers' transaction ids",
            lambda conn: marker_xids(conn, self.job, sinks, window_ids),
        )
        out: dict[str, dict[int, CommitRecord]] = {}
        for sink, wid, xid in rows:
            out.setdefault(str(sink), {})[int(wid)] = CommitRecord(commit_ref=str(xid))
        return out

    def restated_through(self) -> int:
        row = self._read(
            "read the sinks' last restatement",
            lambda conn: conn.execute(
                "SELECT coalesce(max(seq), 0) FROM onceflow.restate_commits"
                " WHERE job = %s AND sink = ANY(%s)",
                (self.job, list(self.by_name)),
            ).fetchone(),
        )
        return int(row[0]) if row else 0

    # -- commit -------------------------------------------------------------------------------

    def begin(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        sinks: Sequence[str],
        *,
        epoch: int,
        run_id: str,
    ) -> WindowWrite:
        todo = [self.by_name[n] for n in sinks if n in self.by_name]
        if not todo:
            return WindowWrite([])
        try:
            # An `order_by` sink stages its rows' positions too, where the output keeps them.
            available = {
                s.name: outputs[s.output].columns
                for s in todo
                if s.order_by is not None and s.output in outputs
            }
            writers = self._tx.begin_stage(
                todo, window.window_id, epoch, "w", fenced=self._exactly_once, available=available
            )
        except TransientSinkError as exc:
            # No staging now: `finish` stages each sink on its own, as a retry does.
            _log.warning("window %d: staging not prepared (%s)", window.window_id, exc)
            writers = []
        return WindowWrite([s.name for s in todo], writers, time.monotonic())

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
        staged = [
            Staged(self.by_name[w.key], w.table, rows_written(results.get(w.key, [])), w.positioned)
            for w in write.writers
            if isinstance(w, CopyWriter)
        ]
        return self._run(
            window,
            outputs,
            [self.by_name[n] for n in write.sinks],
            epoch=epoch,
            run_id=run_id,
            exactly_once=exactly_once,
            staged=staged if len(staged) == len(write.sinks) else None,
            started=write.state,
        )

    def _run(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        todo: list[PostgresSink],
        *,
        epoch: int,
        run_id: str,
        exactly_once: bool,
        seq: int | None = None,
        staged: list[Staged] | None = None,
        started: float | None = None,
    ) -> dict[str, SinkOutcome]:
        """Stage (unless `staged` already holds every sink of `todo`) and apply; staged again
        when the staged rows were lost or a lock wait timed out (`TransientSinkError`), with the
        backoff and deadline of a lost connection (`ONCEFLOW_PG_RETRY_S`). A lost connection is
        the transaction's and the COPY's own to retry, never this loop's. The markers and the
        fence, checked inside the transaction, decide what an attempt may still write.

        Raises:
            TransientSinkError: Staging kept failing past the deadline (retryable: the run
                exits 75 and the orchestrator runs it again).
        """
        started = time.monotonic() if started is None else started
        outcomes: dict[str, SinkOutcome] = {}
        delays: Callable[[], float | None] | None = None
        attempt = 0
        while True:
            if attempt and (exactly_once or seq is not None):
                # A run that lost its sessions may have been fenced meanwhile: stop, don't write.
                self.ctx.ledger.check_epoch(epoch)
                if seq is None:
                    held = self.held([window.window_id])
                    for spec in [s for s in todo if window.window_id in held[s.name]]:
                        outcomes[spec.name] = SinkOutcome(spec.name, False, True)
                    todo = [s for s in todo if s.name not in outcomes]
                    if not todo:
                        return outcomes
            current: list[Staged] = staged if staged is not None and not attempt else []
            try:
                tag = f"r{seq}" if seq is not None else "w"
                if not current:
                    fenced = exactly_once or seq is not None
                    for spec in todo:
                        df = outputs[spec.output]
                        staged_copy = self._tx.stage(
                            spec, df, window.window_id, epoch, tag, fenced=fenced
                        )
                        current.append(staged_copy)
                faults.point("pg_staged", window.window_id)
                applied, xid = self._tx.run(
                    current,
                    window_id=window.window_id,
                    epoch=epoch,
                    run_id=run_id,
                    offsets=window.offsets,
                    exactly_once=exactly_once,
                    restate_seq=seq,
                )
            except TransientSinkError as exc:
                delays = delays or retry_delays(retry_deadline_s())
                delay = delays()
                if delay is None:
                    raise TransientSinkError(
                        f"job {self.job}: window {window.window_id} could not be committed to "
                        f"PostgreSQL within {RETRY_ENV} ({exc}); nothing was written. Run the "
                        "job again: it resumes where this run stopped."
                    ) from None
                attempt += 1
                _log.warning(
                    "window %d: PostgreSQL attempt %d failed (%s); staging again",
                    window.window_id,
                    attempt,
                    exc,
                )
                time.sleep(delay)
                continue
            finally:
                self._tx.drop(current)
            latency = time.monotonic() - started
            outcomes.update(_outcomes(applied, xid, latency))
            return outcomes

    # -- restatement --------------------------------------------------------------------------

    def check_restate(self, window: Window) -> None:
        held = self.held([window.window_id])
        accumulating = [s.name for s in self.specs if s.mode == "accumulate"]
        recorded = self._read(
            f"read window {window.window_id}'s recorded contributions",
            lambda conn: {
                name: has_contribution(conn, self.job, name, window.window_id)
                for name in accumulating
            },
        )
        for spec in self.specs:
            if window.window_id not in held[spec.name]:
                raise SinkError(
                    f"sink {spec.name}: window {window.window_id} is not committed yet; run "
                    "the job first, then restate it."
                )
            if spec.mode == "accumulate":
                if not recorded[spec.name]:
                    raise SinkError(
                        f"sink {spec.name}: window {window.window_id}'s contribution is not "
                        "on record (windows past the job's detail horizon lose it at "
                        "`onceflow maintain`), so it cannot be taken back; reconcile the sink "
                        "instead."
                    )
            elif spec.window_column is None:
                raise SinkError(
                    f"sink {spec.name}: has no window_column, so a window's rows cannot be "
                    "found to restate them; declare one in the sink."
                )

    def fold_records(self, conn: psycopg.Connection, through: int) -> int:
        return _folded.fold(conn, self.job, list(self.by_name), through)

    def forget_detail(self, conn: psycopg.Connection, through: int) -> int:
        accumulating = [s.name for s in self.specs if s.mode == "accumulate"]
        if not accumulating:
            return 0
        return forget_contributions(conn, self.job, accumulating, through)

    def restatement_applied(self, seq: int) -> set[str]:
        # The sinks' transaction wrote a marker per sink with the rows: all or none.
        rows = self._read(
            f"read restatement {seq}'s markers",
            lambda conn: conn.execute(
                "SELECT sink FROM onceflow.restate_commits"
                " WHERE job = %s AND seq = %s AND sink = ANY(%s)",
                (self.job, seq, list(self.by_name)),
            ).fetchall(),
        )
        return {str(r[0]) for r in rows}

    def restate(
        self,
        window: Window,
        outputs: Mapping[str, DataFrame],
        *,
        epoch: int,
        run_id: str,
        seq: int,
    ) -> dict[str, SinkOutcome]:
        return self._run(
            window, outputs, list(self.specs), epoch=epoch, run_id=run_id, exactly_once=True,
            seq=seq,
        )  # fmt: skip

    # -- reconcile ----------------------------------------------------------------------------

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
        return _compare.reconcile_sink(
            spark, self.by_name[sink], expected, scope,
            committed=frozenset(self.held(scope.windows)[sink]), ctx=self.ctx, read=self._read,
            epoch=epoch, run_id=run_id, workdir=workdir,
        )  # fmt: skip

    def reconcile_since(self, sink: str, verified: int) -> int:
        return _compare.reconcile_since(
            self.by_name[sink], self.job, verified,
            replaced=sink in self._replaced(), read=self._read,
        )  # fmt: skip

    # -- the rest -----------------------------------------------------------------------------

    def check_retention(
        self, oldest_window: datetime | None, *, records_elsewhere: bool = False
    ) -> None:
        # Markers are rows: PostgreSQL never forgets them.
        return None

    def data_version(self, sink: str) -> int | None:
        return None

    def quality_targets(self) -> list[Target]:
        return quality_targets(self.specs, self.ctx.job)

    def table_facts(self, sink: str) -> TableFacts:
        spec = self.by_name[sink]
        counted = self._read(
            f"count the rows of {sink}", lambda conn: count_rows(conn, spec, self.job)
        )
        return TableFacts(
            uri=f"{database_uri(self.ctx.dsn)}/{spec.schema}.{spec.table}",
            columns=spec.declared_columns(),
            row_count=counted[0] if counted else None,
            row_count_estimated=bool(counted and counted[1]),
        )

    def status(self) -> dict[str, dict[str, Any]]:
        counts = self._summary("read the commit state")
        return {
            spec.name: {
                "kind": self.kind,
                "table": f"{spec.schema}.{spec.table}",
                "committed_windows": counts.get(spec.name, (0, 0))[0],
                "committed_through": counts.get(spec.name, (0, 0))[1],
            }
            for spec in self.specs
        }


def _outcomes(applied: list[Applied], xid: str | None, latency: float) -> dict[str, SinkOutcome]:
    return {
        a.sink: SinkOutcome(
            a.sink,
            committed=not a.already_committed,
            already_committed=a.already_committed,
            rows=a.rows,
            commit_ref=None if a.already_committed else xid,
            latency_s=latency,
        )
        for a in applied
    }
