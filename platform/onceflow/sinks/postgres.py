"""The PostgreSQL commit protocol: one transaction per window and sink, with a marker.

1. Executors COPY the window's rows into an UNLOGGED staging table (one per window, sink and
   epoch), so no window is collected onto the driver.
2. One transaction on the driver: lock the job row if this run's epoch is still current (the
   fence), return if the window's marker exists, move the rows from staging into the table
   (append, upsert or accumulate), insert the marker `onceflow.sink_commits`, COMMIT.
3. If COMMIT gets no answer, reconnect and decide by the marker: it is the authority. The saved
   `pg_current_xact_id()` is only used to wait while the transaction is still `in progress`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow import faults
from onceflow.errors import CommitUnknownError, FencedError, SinkError, TransientSinkError
from onceflow.job import PostgresSink
from onceflow.ledger import Ledger, application_name
from onceflow.postgres import connect

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

_log = logging.getLogger(__name__)

# How long to keep trying to learn the outcome of a COMMIT that got no answer.
RESOLVE_TIMEOUT_S = 120.0
# Attempts at a window's commit when the connection breaks before COMMIT was sent.
COMMIT_ATTEMPTS = 5


_INSERT_MARKER = (
    "INSERT INTO onceflow.sink_commits (job, sink, window_id, epoch, xid, run_id, offsets,"
    " rows_written) VALUES (%s, %s, %s, %s, pg_current_xact_id(), %s, %s, %s)"
)
# Without markers checks (at_least_once) a replay writes again; the marker counts every write.
_UPSERT_MARKER = (
    _INSERT_MARKER + " ON CONFLICT (job, sink, window_id) DO UPDATE SET epoch = EXCLUDED.epoch,"
    " xid = EXCLUDED.xid, run_id = EXCLUDED.run_id,"
    " rows_written = onceflow.sink_commits.rows_written + EXCLUDED.rows_written,"
    " committed_at = now()"
)


@dataclass(frozen=True)
class _Marker:
    """The commit record of one window (or one restatement of it) in one sink."""

    job: str
    sink: str
    window_id: int
    restate_seq: int | None
    exactly_once: bool

    def epoch_of(self, conn: psycopg.Connection) -> int | None:
        """The epoch that wrote this window's marker, or None if there is none."""
        if self.restate_seq is not None:
            return 0 if self.exists(conn) else None
        row = conn.execute(
            "SELECT epoch FROM onceflow.sink_commits WHERE job = %s AND sink = %s AND window_id = %s",
            (self.job, self.sink, self.window_id),
        ).fetchone()
        return None if row is None else int(row[0])

    def exists(self, conn: psycopg.Connection) -> bool:
        if self.restate_seq is None:
            query = (
                "SELECT 1 FROM onceflow.sink_commits"
                " WHERE job = %s AND sink = %s AND window_id = %s"
            )
            params: tuple[Any, ...] = (self.job, self.sink, self.window_id)
        else:
            query = (
                "SELECT 1 FROM onceflow.restate_commits WHERE job = %s AND sink = %s AND seq = %s"
            )
            params = (self.job, self.sink, self.restate_seq)
        return conn.execute(query, params).fetchone() is not None

    def insert(
        self,
        conn: psycopg.Connection,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        rows: int,
    ) -> None:
        if self.restate_seq is not None:
            conn.execute(
                "INSERT INTO onceflow.restate_commits (job, sink, seq, xid, rows_written)"
                " VALUES (%s, %s, %s, pg_current_xact_id(), %s)",
                (self.job, self.sink, self.restate_seq, rows),
            )
            return
        conn.execute(
            _INSERT_MARKER if self.exactly_once else _UPSERT_MARKER,
            (self.job, self.sink, self.window_id, epoch, run_id, json.dumps(offsets), rows),
        )


@dataclass(frozen=True)
class PostgresCommit:
    """What a window's PostgreSQL commit did."""

    rows: int
    xid: str | None
    already_committed: bool
    resolved_after_unanswered_commit: bool = False


def _staging_name(job: str, sink: str, window_id: int, epoch: int) -> str:
    digest = hashlib.sha1(f"{job}/{sink}/{window_id}/{epoch}".encode()).hexdigest()[:20]
    return f"stage_{digest}"


def _copy_partition(dsn: str, app_name: str, schema: str, table: str, columns: list[str]) -> Any:
    """A mapInArrow function: COPY each executor partition into the staging table."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import psycopg
        import pyarrow as pa
        import pyarrow.csv as pacsv
        from psycopg import sql

        total = 0
        statement = sql.SQL("COPY {}.{} ({}) FROM STDIN (FORMAT csv)").format(
            sql.Identifier(schema),
            sql.Identifier(table),
            sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        )
        options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
        with psycopg.connect(dsn, application_name=app_name) as conn:
            with conn.cursor() as cur, cur.copy(statement) as copy:
                for batch in batches:
                    if batch.num_rows == 0:
                        continue
                    buffer = io.BytesIO()
                    pacsv.write_csv(pa.Table.from_batches([batch]), buffer, options)
                    copy.write(buffer.getvalue())
                    total += batch.num_rows
            conn.commit()
        yield pa.RecordBatch.from_pydict({"rows": [total]})

    return run


class PostgresTableSink:
    """The PostgreSQL side of one sink of one job."""

    def __init__(self, job: str, spec: PostgresSink, dsn: str, ledger: Ledger) -> None:
        self.job = job
        self.spec = spec
        self._dsn = dsn
        self.ledger = ledger
        self.target = sql.Identifier(spec.schema, spec.table)

    # -- table --------------------------------------------------------------------------------

    def ensure_table(self) -> None:
        spec = self.spec
        columns = [
            sql.SQL("{} {}{}").format(
                sql.Identifier(name),
                sql.SQL(pg_type),
                sql.SQL(" NOT NULL")
                if name in spec.key or name in spec.accumulate
                else sql.SQL(""),
            )
            for name, pg_type in spec.columns.items()
        ]
        if spec.key:
            columns.append(
                sql.SQL("PRIMARY KEY ({})").format(
                    sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
                )
            )
        with connect(self._dsn) as conn:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(spec.schema))
            )
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    self.target, sql.SQL(", ").join(columns)
                )
            )
            conn.commit()

    def committed_windows(self) -> set[int]:
        return set(self.ledger.markers(self.spec.name))

    # -- commit -------------------------------------------------------------------------------

    def commit_window(
        self,
        df: DataFrame,
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        exactly_once: bool = True,
    ) -> PostgresCommit:
        """Commit the window's rows in one transaction, unless the marker says it is there."""
        marker = _Marker(self.job, self.spec.name, window_id, None, exactly_once)
        return self._commit_loop(df, marker, epoch, run_id, offsets)

    def restate_window(
        self,
        new: DataFrame,
        old: DataFrame | None,
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        seq: int,
    ) -> PostgresCommit:
        """Replace the window's effect in one transaction (restatement `seq`, applied once).

        Keyed sinks with a window column lose the window's rows and get the new ones; an
        accumulating sink gets the new contribution minus the old one (`old`).
        """
        spec = self.spec
        if spec.mode == "accumulate":
            if old is None:
                raise SinkError(
                    f"sink {spec.name}: window {window_id}'s old contribution is not on record, "
                    "so it cannot be taken back; reconcile the sink instead."
                )
            from pyspark.sql import functions as F

            keys = list(spec.key)
            negated = old.select(
                *keys, *(F.negate(F.col(c).cast("decimal(38,0)")).alias(c) for c in spec.accumulate)
            )
            positive = new.select(
                *keys, *(F.col(c).cast("decimal(38,0)").alias(c) for c in spec.accumulate)
            )
            new = (
                positive.unionByName(negated)
                .groupBy(*keys)
                .agg(*(F.sum(c).alias(c) for c in spec.accumulate))
            )
        elif spec.window_column is None:
            raise SinkError(
                f"sink {spec.name}: has no window_column, so a window's rows cannot be found "
                "to restate them."
            )
        marker = _Marker(self.job, spec.name, window_id, seq, True)
        return self._commit_loop(new, marker, epoch, run_id, {})

    def _commit_loop(
        self,
        df: DataFrame,
        marker: _Marker,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
    ) -> PostgresCommit:
        last_error: Exception | None = None
        for attempt in range(COMMIT_ATTEMPTS):
            if marker.exactly_once:
                # A run that lost its sessions may have been fenced meanwhile: stop, don't write.
                self.ledger.check_epoch(epoch)
                with connect(self._dsn) as conn:
                    if marker.exists(conn):
                        return PostgresCommit(0, None, True)
            try:
                staging = self._stage(df, marker.window_id, epoch)
                return self._commit_from_staging(staging, marker, epoch, run_id, offsets)
            except TransientSinkError as exc:
                last_error = exc
                _log.warning(
                    "sink %s window %d: attempt %d failed (%s); retrying",
                    self.spec.name,
                    marker.window_id,
                    attempt + 1,
                    exc,
                )
                time.sleep(min(2**attempt, 10))
        raise SinkError(
            f"sink {self.spec.name}: window {marker.window_id} could not be committed after "
            f"{COMMIT_ATTEMPTS} attempts: {last_error}"
        )

    def _stage(self, df: DataFrame, window_id: int, epoch: int) -> str:
        spec = self.spec
        name = _staging_name(self.job, spec.name, window_id, epoch)
        staging = sql.Identifier("onceflow", name)
        columns = [
            sql.SQL("{} {}").format(
                sql.Identifier(col),
                # Accumulated deltas are summed exactly; the cast back to the column's type
                # happens on the final value, so a window cannot overflow halfway.
                sql.SQL("numeric") if col in spec.accumulate else sql.SQL(pg_type),
            )
            for col, pg_type in spec.columns.items()
        ]
        try:
            with connect(self._dsn, application_name=application_name(self.job, epoch)) as conn:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
                conn.execute(
                    sql.SQL("CREATE UNLOGGED TABLE {} ({})").format(
                        staging, sql.SQL(", ").join(columns)
                    )
                )
                conn.commit()
        except psycopg.OperationalError as exc:
            raise TransientSinkError(f"staging table: {type(exc).__name__}") from None
        column_names = list(spec.columns)
        copier = _copy_partition(
            self._dsn, application_name(self.job, epoch), "onceflow", name, column_names
        )
        try:
            df.select(*column_names).mapInArrow(copier, "rows long").groupBy().sum("rows").collect()
        except Exception as exc:
            raise TransientSinkError(
                f"copy into staging failed on an executor ({type(exc).__name__})"
            ) from None
        return name

    def _apply(self, conn: psycopg.Connection, staging: sql.Composable) -> int:
        spec = self.spec
        cols = list(spec.columns)
        col_list = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
        key_list = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
        if spec.mode == "append":
            cur = conn.execute(
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                    self.target, col_list, col_list, staging
                )
            )
            return cur.rowcount
        if spec.mode == "upsert":
            others = [c for c in cols if c not in spec.key]
            action = (
                sql.SQL("DO UPDATE SET {}").format(
                    sql.SQL(", ").join(
                        sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                        for c in others
                    )
                )
                if others
                else sql.SQL("DO NOTHING")
            )
            cur = conn.execute(
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT ({}) {}").format(
                    self.target, col_list, col_list, staging, key_list, action
                )
            )
            return cur.rowcount
        # accumulate: add into existing rows, insert the rest; sums are exact (numeric) and
        # only the final value must fit the column.
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{} = s.{}").format(sql.Identifier(k), sql.Identifier(k)) for k in spec.key
        )
        sets = sql.SQL(", ").join(
            sql.SQL("{} = (t.{}::numeric + s.{})::{}").format(
                sql.Identifier(c), sql.Identifier(c), sql.Identifier(c), sql.SQL(spec.columns[c])
            )
            for c in spec.accumulate
        )
        others = [c for c in cols if c not in spec.key and c not in spec.accumulate]
        if others:
            sets = sql.SQL(", ").join(
                [
                    sets,
                    *(
                        sql.SQL("{} = s.{}").format(sql.Identifier(c), sql.Identifier(c))
                        for c in others
                    ),
                ]
            )
        updated = conn.execute(
            sql.SQL("UPDATE {} AS t SET {} FROM {} AS s WHERE {}").format(
                self.target, sets, staging, match
            )
        ).rowcount
        casts = sql.SQL(", ").join(
            sql.SQL("s.{}::{}").format(sql.Identifier(c), sql.SQL(spec.columns[c])) for c in cols
        )
        inserted = conn.execute(
            sql.SQL(
                "INSERT INTO {} ({}) SELECT {} FROM {} AS s"
                " WHERE NOT EXISTS (SELECT 1 FROM {} AS t WHERE {})"
            ).format(self.target, col_list, casts, staging, self.target, match)
        ).rowcount
        return updated + inserted

    def _commit_from_staging(
        self,
        staging_name: str,
        marker: _Marker,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
    ) -> PostgresCommit:
        staging = sql.Identifier("onceflow", staging_name)
        window_id = marker.window_id
        conn = self.ledger.connect(epoch)
        xid: str | None = None
        commit_sent = False
        try:
            conn.execute("SET LOCAL synchronous_commit = on")
            if marker.exactly_once:
                self.ledger.fence(conn, epoch)
                if marker.exists(conn):
                    conn.rollback()
                    return PostgresCommit(0, None, True)
            if marker.restate_seq is not None and self.spec.window_column is not None:
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE {} = %s").format(
                        self.target, sql.Identifier(self.spec.window_column)
                    ),
                    (window_id,),
                )
            rows = self._apply(conn, staging)
            if marker.restate_seq is not None and self.spec.mode == "accumulate":
                self._drop_emptied(conn, staging)
            row = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
            assert row is not None
            xid = str(row[0])
            marker.insert(conn, epoch, run_id, offsets, rows)
            faults.point("before_pg_commit", window_id)
            if faults_wants_unanswered(window_id):
                conn.pgconn.send_query(b"COMMIT")
                conn.pgconn.flush()
                faults.point("pg_commit_sent", window_id)
            commit_sent = True
            conn.commit()
        except psycopg.OperationalError as exc:
            if not commit_sent or xid is None:
                raise TransientSinkError(
                    f"connection lost before COMMIT ({type(exc).__name__})"
                ) from None
            _log.warning(
                "sink %s window %d: COMMIT got no answer; deciding by the marker",
                self.spec.name,
                window_id,
            )
            if not self.resolve_unanswered_commit(marker, xid, epoch):
                raise TransientSinkError("COMMIT was not applied by the server") from None
            self._drop(staging)
            return PostgresCommit(rows, xid, False, resolved_after_unanswered_commit=True)
        except psycopg.errors.LockNotAvailable:
            conn.rollback()
            raise TransientSinkError("lock wait timed out") from None
        except psycopg.errors.NumericValueOutOfRange:
            conn.rollback()
            raise SinkError(
                f"sink {self.spec.name}: window {window_id} would take a value past its column's "
                "range (an accumulated total no longer fits); nothing was written. Widen the "
                "column or restate the window."
            ) from None
        except psycopg.Error as exc:
            # The server's message and DETAIL quote row values (payments are sensitive): keep
            # only the error class and SQLSTATE.
            conn.rollback()
            raise SinkError(
                f"sink {self.spec.name}: PostgreSQL refused window {window_id} "
                f"({type(exc).__name__}, SQLSTATE {exc.sqlstate}); nothing was written. Check "
                f"the table {self.spec.schema}.{self.spec.table} for constraints or changes made "
                "outside onceflow."
            ) from None
        finally:
            conn.close()
        self._drop(staging)
        return PostgresCommit(rows, xid, False)

    def _drop_emptied(self, conn: psycopg.Connection, staging: sql.Composable) -> None:
        """After a restatement, remove accumulated rows that no longer hold anything."""
        spec = self.spec
        conn.execute(
            sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {} AND {}").format(
                self.target,
                staging,
                sql.SQL(" AND ").join(
                    sql.SQL("t.{} = s.{}").format(sql.Identifier(k), sql.Identifier(k))
                    for k in spec.key
                ),
                sql.SQL(" AND ").join(
                    sql.SQL("t.{} = 0").format(sql.Identifier(c)) for c in spec.accumulate
                ),
            )
        )

    def resolve_unanswered_commit(self, marker: _Marker, xid: str, epoch: int) -> bool:
        """Decide whether the transaction `xid` that carried `marker` committed.

        The marker decides: it commits if and only if the rows did. `pg_xact_status` is only
        consulted to wait while the transaction is still in progress; after a server crash an
        xid may be reused, so it never decides "committed" on its own.
        """
        deadline = time.monotonic() + RESOLVE_TIMEOUT_S
        delay = 0.1
        while time.monotonic() < deadline:
            try:
                with connect(self._dsn) as conn:
                    written_by = marker.epoch_of(conn)
                    if written_by is not None:
                        if written_by > epoch:
                            # A newer run wrote the window: ours did not commit, and this run
                            # has been fenced.
                            raise FencedError(
                                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a "
                                f"newer run (epoch {written_by}), which committed window "
                                f"{marker.window_id} to {self.spec.name}; it stopped without writing."
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
            f"sink {self.spec.name}: could not learn whether window {marker.window_id} committed "
            f"within {RESOLVE_TIMEOUT_S:.0f}s; the server is unreachable. Run the job again: it "
            "decides by the commit marker."
        )

    def _drop(self, staging: sql.Composable) -> None:
        try:
            with connect(self._dsn) as conn:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
                conn.commit()
        except Exception:  # staging litter is harmless; the next run drops it
            _log.debug("could not drop staging table", exc_info=True)


def faults_wants_unanswered(window_id: int) -> bool:
    """True when the fault `pg_commit_sent` is armed for this window (crash tests only)."""
    import os

    spec = os.environ.get("ONCEFLOW_FAULT", "")
    if not spec.startswith("pg_commit_sent"):
        return False
    if "@" in spec:
        return spec.split("@", 1)[1].split(":", 1)[0] == str(window_id)
    return True
