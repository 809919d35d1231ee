"""The PostgreSQL commit protocol: one transaction per window for all of a job's PostgreSQL sinks.

1. Executors COPY each sink's rows into an UNLOGGED staging table (one per window, sink and
   epoch; a COPY commits only while the epoch is current) and report how many rows they wrote,
   so no window is collected onto the driver.
2. One transaction on the driver: lock the job row if this run's epoch is still current (the
   fence); for each sink, skip it if its marker for the window exists, lock its staging table
   against writers and check that it holds exactly the staged rows (a server crash-restart
   empties UNLOGGED tables, a stale task attempt adds to them: then stage again), move the
   rows into the table (append, upsert or accumulate; an accumulating sink also records the
   window's contribution, so a restatement can take it back), and insert the marker
   `onceflow.sink_commits`; then COMMIT, with `synchronous_commit = on`.
3. If COMMIT gets no answer, reconnect and decide by the markers: they are the authority. The
   saved `pg_current_xact_id()` is only used to wait while the transaction is `in progress`;
   after a server crash an xid may be reused, so it never decides "committed" on its own.

A restatement uses the same transaction shape with `onceflow.restate_commits` markers: keyed
sinks lose the window's rows and get the new ones; accumulating sinks get the new contribution
minus the recorded old one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow import faults
from onceflow._identifiers import session_name
from onceflow._pgcopy import POSITION, CopyWriter, lock_and_count
from onceflow.errors import (
    CommitUnknownError,
    FencedError,
    SinkError,
    SinkStateError,
    TransientSinkError,
)
from onceflow.postgres import (
    connect,
    is_lost_connection,
    refusal_details,
    retrying,
)
from onceflow.sinks.postgres._accumulate import target_table
from onceflow.sinks.postgres._apply import apply_staged, restate_staged
from onceflow.sinks.postgres._columns import table_problems
from onceflow.sinks.postgres._markers import Marker
from onceflow.sinks.postgres.spec import PostgresSink
from onceflow.sinks.writers import rows_written, run_writers

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.ledger import Ledger


_log = logging.getLogger(__name__)


# How long to keep trying to learn the outcome of a COMMIT that got no answer.
RESOLVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Staged:
    """One sink's rows of one window, copied into a staging table by the executors."""

    spec: PostgresSink
    table: str  # the staging table's name in schema onceflow
    rows: int
    positioned: bool = False  # it holds the rows' `POSITION` columns too

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier("onceflow", self.table)


@dataclass(frozen=True)
class Applied:
    """What the transaction did for one sink."""

    sink: str
    rows: int  # rows written (inserted, replaced or updated)
    already_committed: bool


def staged_columns(spec: PostgresSink, available: Sequence[str]) -> list[str]:
    """The columns a sink's staging table takes from an output with `available` columns: the
    sink's, and for an `order_by` upsert the rows' positions where the output keeps them."""
    columns = list(spec.columns)
    if spec.order_by is not None and all(c in available for c in POSITION):
        columns += [c for c in POSITION if c not in columns]
    return columns


class _KeyTaken(Exception):
    """A fresh insert met a key its table holds (or two rows of one key): the transaction was
    rolled back, and the window is committed again with that sink upserting."""

    def __init__(self, sink: str) -> None:
        super().__init__(sink)
        self.sink = sink


def _staging_name(job: str, sink: str, window_id: int, epoch: int, tag: str) -> str:
    digest = hashlib.sha1(f"{job}/{sink}/{window_id}/{epoch}/{tag}".encode()).hexdigest()[:20]
    return f"stage_{digest}"


class Transaction:
    """Commits one window (or one restatement) to several PostgreSQL sinks of one job at once."""

    def __init__(self, job: str, dsn: str, ledger: Ledger) -> None:
        self.job = job
        self._dsn = dsn
        self.ledger = ledger
        # Upsert sinks whose windows met a key their table held, in this run: they upsert from
        # then on. The others insert each window as it is, since a window of new keys (the
        # common case: payments, events) costs half as much that way. A failed insert rolls
        # the whole transaction back (never a savepoint: every row of a window carries its
        # transaction's xid, which lineage reports), so it is tried at most once a sink a run.
        self._upserting: set[str] = set()

    # -- staging ------------------------------------------------------------------------------

    def begin_stage(
        self,
        specs: Sequence[PostgresSink],
        window_id: int,
        epoch: int,
        tag: str,
        *,
        fenced: bool = True,
        available: Mapping[str, Sequence[str]] | None = None,
    ) -> list[CopyWriter]:
        """Create the sinks' staging tables (one round trip); return the writers the executors
        COPY each sink's rows with (`key` = the sink's name). The tables are the epoch's own;
        `fenced`: the COPYs commit only while the epoch is current. `available`: the columns
        of each `order_by` sink's output (`staged_columns`)."""
        names = {s.name: _staging_name(self.job, s.name, window_id, epoch, tag) for s in specs}
        app = session_name(self.job, epoch)
        columns = {s.name: staged_columns(s, (available or {}).get(s.name, ())) for s in specs}
        self._create_staging(specs, names, columns, app, window_id)
        fence = (self.job, epoch) if fenced else None
        return [
            CopyWriter(
                s.name, s.output, self._dsn, app, names[s.name], columns[s.name], fence=fence
            )
            for s in specs
        ]

    def _create_staging(
        self,
        specs: Sequence[PostgresSink],
        names: dict[str, str],
        staged: dict[str, list[str]],
        app: str,
        window_id: int,
    ) -> None:
        statements: list[sql.Composable] = []
        for spec in specs:
            staging = sql.Identifier("onceflow", names[spec.name])
            columns = [
                sql.SQL("{} {}").format(
                    sql.Identifier(col),
                    # Accumulated deltas are summed exactly; the cast back to the column's type
                    # happens on the final value, so a window cannot overflow halfway.
                    sql.SQL("numeric")
                    if col in spec.accumulate
                    else sql.SQL(spec.columns.get(col, "bigint")),
                )
                for col in staged[spec.name]
            ]
            statements.append(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
            statements.append(
                sql.SQL("CREATE UNLOGGED TABLE {} ({})").format(
                    staging, sql.SQL(", ").join(columns)
                )
            )

        def create() -> None:  # done again, whole, after a lost connection
            with connect(self._dsn, application_name=app) as conn:
                # No parameters: the statements go as one query, in one round trip.
                conn.execute(sql.SQL("; ").join(statements))
                conn.commit()

        sinks = ", ".join(s.name for s in specs)
        try:
            retrying(
                create,
                what=f"create the staging tables of {sinks} (window {window_id})",
                dsn=self._dsn,
            )
        except psycopg.OperationalError as exc:
            raise TransientSinkError(f"staging table: {type(exc).__name__}") from None

    def stage(
        self,
        spec: PostgresSink,
        df: DataFrame,
        window_id: int,
        epoch: int,
        tag: str,
        *,
        fenced: bool = True,
    ) -> Staged:
        """Create the sink's staging table and have the executors COPY `df` into it."""
        available = {spec.name: df.columns} if spec.order_by is not None else None
        (writer,) = self.begin_stage(
            [spec], window_id, epoch, tag, fenced=fenced, available=available
        )
        try:
            rows = rows_written(run_writers({spec.output: df}, [writer]).written[writer.key])
        except Exception as exc:
            raise TransientSinkError(
                f"copy into staging failed on an executor ({type(exc).__name__})"
            ) from None
        return Staged(spec, writer.table, rows, writer.positioned)

    def drop(self, staged: Sequence[Staged]) -> None:
        if not staged:
            return
        try:
            # One statement: one transaction (one WAL flush) for all of a window's tables.
            with connect(self._dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP TABLE IF EXISTS {}").format(
                        sql.SQL(", ").join(item.ident for item in staged)
                    )
                )
        except Exception:  # staging litter is harmless; the next run drops it
            _log.debug("could not drop staging tables", exc_info=True)

    # -- the transaction ----------------------------------------------------------------------

    def run(
        self,
        staged: Sequence[Staged],
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        exactly_once: bool,
        restate_seq: int | None = None,
    ) -> tuple[list[Applied], str | None]:
        """Apply every staged sink in one transaction; return what each did and the xid.

        A connection lost before COMMIT, or a COMMIT the markers show was not applied, is
        retried here, with the same staging tables, until ONCEFLOW_PG_RETRY_S (the one retry of
        a lost connection on the driver's commit).

        Raises:
            TransientSinkError: A staging table lost rows, or a lock wait timed out: the group
                stages again.
            FencedError: A newer run took over.
            SinkError: PostgreSQL refused the window; nothing was written.
            PostgresUnavailableError: The server stayed unreachable.
        """
        what = f"commit window {window_id} to PostgreSQL" + (
            f" (restatement {restate_seq})" if restate_seq is not None else ""
        )
        while True:
            try:
                return retrying(
                    lambda: self._attempt(
                        staged,
                        window_id=window_id,
                        epoch=epoch,
                        run_id=run_id,
                        offsets=offsets,
                        exactly_once=exactly_once,
                        restate_seq=restate_seq,
                    ),
                    what=what,
                    dsn=self._dsn,
                )
            except _KeyTaken as taken:
                _log.info(
                    "window %d: sink %s meets keys its table holds; it upserts from now on",
                    window_id,
                    taken.sink,
                )
                self._upserting.add(taken.sink)

    def _attempt(
        self,
        staged: Sequence[Staged],
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        exactly_once: bool,
        restate_seq: int | None,
    ) -> tuple[list[Applied], str | None]:
        markers = {
            s.spec.name: Marker(self.job, s.spec.name, window_id, restate_seq) for s in staged
        }
        fenced = exactly_once or restate_seq is not None
        conn = self.ledger.connect(epoch)
        xid: str | None = None
        commit_sent = False
        applied: list[Applied] = []
        try:
            conn.execute("SET LOCAL synchronous_commit = on")
            if fenced:
                self.ledger.fence(conn, epoch)
                _check_tables(conn, self.job, [item.spec for item in staged])
            for item in staged:
                marker = markers[item.spec.name]
                if fenced and marker.exists(conn):
                    applied.append(Applied(item.spec.name, 0, True))
                    continue
                self._check_staged(conn, item)
                if restate_seq is None:
                    fresh = item.spec.mode == "upsert" and item.spec.name not in self._upserting
                    try:
                        rows, added = apply_staged(
                            conn,
                            item.spec,
                            item.ident,
                            self.job,
                            window_id,
                            item.positioned,
                            fresh=fresh,
                        )
                    except psycopg.errors.UniqueViolation:
                        if not fresh:
                            raise
                        conn.rollback()
                        raise _KeyTaken(item.spec.name) from None
                else:
                    rows, added = restate_staged(
                        conn, item.spec, item.ident, self.job, window_id, item.positioned
                    )
                # The marker records the rows the window added to the table, so the table's
                # row count can be checked against the markers.
                marker.insert(conn, epoch, run_id, offsets, added, exactly_once=exactly_once)
                applied.append(Applied(item.spec.name, rows, False))
            if all(a.already_committed for a in applied):
                conn.rollback()
                return applied, None
            row = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
            assert row is not None
            xid = str(row[0])
            faults.point("before_pg_commit", window_id)
            if faults.armed("pg_commit_sent", window_id):
                conn.pgconn.send_query(b"COMMIT")
                conn.pgconn.flush()
                faults.point("pg_commit_sent", window_id)
            commit_sent = True
            conn.commit()
        except psycopg.errors.LockNotAvailable:
            # Before the OperationalError branch: it is one, but the session is alive.
            conn.rollback()
            raise TransientSinkError("lock wait timed out") from None
        except psycopg.OperationalError as exc:
            if not commit_sent or xid is None:
                if is_lost_connection(exc):
                    raise  # nothing was applied: `run` tries again
                raise TransientSinkError(
                    f"connection lost before COMMIT ({type(exc).__name__})"
                ) from None
            _log.warning("window %d: COMMIT got no answer; deciding by the markers", window_id)
            first = next(a for a in applied if not a.already_committed)
            if not self._resolve(markers[first.sink], xid, epoch):
                if not is_lost_connection(exc):
                    raise TransientSinkError("COMMIT was not applied by the server") from None
                _log.warning("window %d: the COMMIT was not applied; trying again", window_id)
                raise  # `run` tries again, with the same staging tables
            return applied, xid
        except psycopg.errors.NumericValueOutOfRange:
            conn.rollback()
            raise SinkError(
                f"job {self.job}: window {window_id} would take a value past its column's range "
                "(an accumulated total no longer fits); nothing was written. Widen the column or "
                "restate the window."
            ) from None
        except (TransientSinkError, FencedError, SinkError):
            conn.rollback()
            raise
        except psycopg.Error as exc:
            # The server's message and DETAIL quote row values (payments are sensitive): keep
            # the error class, SQLSTATE and the identifiers of its diagnostics, and name what
            # the tables lack by reading the catalog.
            conn.rollback()
            raise SinkError(self._refused(conn, exc, staged, window_id)) from None
        finally:
            conn.close()
        return applied, xid

    def _refused(
        self, conn: psycopg.Connection, exc: psycopg.Error, staged: Sequence[Staged], window_id: int
    ) -> str:
        """The message of a window PostgreSQL refused: what was refused and, when a table no
        longer fits its sink, what to change."""
        details = refusal_details(exc)
        problems: list[str] = []
        try:
            for item in staged:
                problems += table_problems(conn, item.spec)
        except psycopg.Error:  # the explanation is a courtesy: the refusal stands without it
            _log.debug("could not read the sink tables' columns", exc_info=True)
        head = (
            f"job {self.job}: PostgreSQL refused window {window_id} ({type(exc).__name__}, "
            f"SQLSTATE {exc.sqlstate}{'; ' + details if details else ''}); nothing was written."
        )
        if problems:
            return f"{head} {'; '.join(problems)}. Then run the job again."
        names = ", ".join(f"{s.spec.schema}.{s.spec.table}" for s in staged)
        return f"{head} Check the tables {names} for constraints or changes made outside onceflow."

    def _check_staged(self, conn: psycopg.Connection, item: Staged) -> None:
        """The staging table holds exactly the rows the executors reported, and keeps them
        until the transaction ends (`lock_and_count`)."""
        held = lock_and_count(conn, item.ident)
        if held != item.rows:
            # An UNLOGGED table is emptied by a server crash-restart; a COPY of a stale task
            # attempt adds rows no executor reported. Never apply either.
            raise TransientSinkError(
                f"staging table of {item.spec.name} holds {held} of {item.rows} rows "
                "(the server restarted, or a stale copy landed); staging again"
            )

    def _resolve(self, marker: Marker, xid: str, epoch: int) -> bool:
        """Decide whether the transaction `xid` that carried `marker` committed."""
        deadline = time.monotonic() + RESOLVE_TIMEOUT_S
        delay = 0.1
        while time.monotonic() < deadline:
            try:
                with connect(self._dsn, autocommit=True) as conn:
                    written_by = marker.epoch_of(conn)
                    if written_by is not None:
                        if written_by > epoch:
                            # A newer run wrote the window: ours did not commit, and this run
                            # has been fenced.
                            raise FencedError(
                                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a "
                                f"newer run (epoch {written_by}), which committed window "
                                f"{marker.window_id}; it stopped without writing."
                            )
                        return True
                    try:
                        status = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
                    except psycopg.Error:
                        conn.rollback()
                        status = None
                    if status is None or status[0] != "in progress":
                        return False
            except FencedError:
                raise
            except Exception as exc:  # the server may be restarting: keep asking until the deadline
                _log.info("resolving window %d: %s; retrying", marker.window_id, type(exc).__name__)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise CommitUnknownError(
            f"job {self.job}: could not learn whether window {marker.window_id} committed within "
            f"{RESOLVE_TIMEOUT_S:.0f}s; the server is unreachable. Run the job again: it decides "
            "by the commit markers."
        )


def _check_tables(conn: psycopg.Connection, job: str, specs: Sequence[PostgresSink]) -> None:
    """Inside the window's transaction: each sink's table is the one the ledger recorded (a
    table dropped and created again is another table, and the markers do not describe it)."""
    rows = conn.execute(
        "SELECT x.sink FROM unnest(%s::text[], %s::text[]) AS x(sink, qualified)"
        " JOIN onceflow.sink_tables t ON t.job = %s AND t.sink = x.sink"
        " WHERE to_regclass(x.qualified)::oid::text IS DISTINCT FROM t.identity",
        (
            [spec.name for spec in specs],
            [target_table(spec).as_string(conn) for spec in specs],
            job,
        ),
    ).fetchall()
    if rows:
        names = ", ".join(sorted(str(r[0]) for r in rows))
        raise SinkStateError(
            f"sink {names}: the PostgreSQL table is not the one onceflow wrote (it was dropped "
            "and created again). Nothing was written. Run "
            f"`onceflow reconcile {job}`: it puts back every window the table lacks, then run "
            "the job again."
        )
