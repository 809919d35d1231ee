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
import io
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow import faults
from onceflow._identifiers import session_name
from onceflow.errors import (
    CommitUnknownError,
    FencedError,
    SinkError,
    SinkStateError,
    TransientSinkError,
)
from onceflow.postgres import (
    CONNECT_TIMEOUT_S,
    connect,
    is_lost_connection,
    process_sessions,
    retry_deadline_s,
    retry_delays,
    retrying,
)
from onceflow.sinks.postgres._columns import refusal_details, table_problems
from onceflow.sinks.postgres.spec import PostgresSink
from onceflow.sinks.writers import PartitionHandle, PartitionWriter, rows_written, run_writers

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from onceflow.ledger import Ledger

_log = logging.getLogger(__name__)

# How long to keep trying to learn the outcome of a COMMIT that got no answer.
RESOLVE_TIMEOUT_S = 120.0
# Attempts at a window's commit after a transient failure other than a lost connection (a lost
# connection is retried until ONCEFLOW_PG_RETRY_S).
COMMIT_ATTEMPTS = 5
# An executor keeps up to this much of its partition's CSV in memory (beyond, on local disk), so
# a COPY cut off by a lost connection can be done again without reading the input again.
SPOOL_IN_MEMORY_BYTES = 64 << 20
# The time zone whose timestamps Arrow's CSV writer prints with a "Z" (Spark's session zone
# unless a user changes it; "Etc/UTC" it prints with "+0000").
_UTC = "UTC"
# How long a count check waits for a COPY still under way into the table it counts.
STAGING_LOCK_WAIT_S = 5
# The output columns that place a row in its window's input (the file's place in the window,
# then the line): an `order_by` upsert gives a tie to the later position where the output
# keeps them.
POSITION = ("_file_idx", "_source_line")

PROTOCOL_DDL = """
CREATE SCHEMA IF NOT EXISTS onceflow;
CREATE TABLE IF NOT EXISTS onceflow.sink_commits (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    epoch bigint NOT NULL,
    xid xid8 NOT NULL,
    run_id text,
    offsets jsonb NOT NULL,
    rows_written bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink, window_id)
);
CREATE TABLE IF NOT EXISTS onceflow.restate_commits (
    job text NOT NULL,
    sink text NOT NULL,
    seq bigint NOT NULL,
    xid xid8 NOT NULL,
    rows_written bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink, seq)
);
-- What a window added to an accumulating sink, so a restatement can take it back: one row per
-- window, each key column's values and each accumulated column's sums as one array
-- (`keys[c][r]`, `amounts[c][r]` for the window's r-th key). A row per key (a heap tuple, an
-- index entry and two jsonb values each) cost two and a half times the insert and twelve
-- times the space (benchmarks/postgres_statements_bench.py).
CREATE TABLE IF NOT EXISTS onceflow.window_contributions (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    keys text[] NOT NULL,
    amounts numeric[] NOT NULL,
    PRIMARY KEY (job, sink, window_id)
);
-- Earlier versions kept a row per key here; their windows are still read from it.
CREATE TABLE IF NOT EXISTS onceflow.contributions (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    key jsonb NOT NULL,
    amounts jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS contributions_window ON onceflow.contributions (job, sink, window_id);
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = 'onceflow.contributions'::regclass AND conname = 'contributions_pkey'
    ) THEN
        ALTER TABLE onceflow.contributions DROP CONSTRAINT contributions_pkey;
    END IF;
END
$$;
"""

_INSERT_MARKER = (
    "INSERT INTO onceflow.sink_commits (job, sink, window_id, epoch, xid, run_id, offsets,"
    " rows_written) VALUES (%s, %s, %s, %s, pg_current_xact_id(), %s, %s, %s)"
)
# Without marker checks (at_least_once) a replay writes again; the marker counts every write.
_UPSERT_MARKER = (
    _INSERT_MARKER + " ON CONFLICT (job, sink, window_id) DO UPDATE SET epoch = EXCLUDED.epoch,"
    " xid = EXCLUDED.xid, run_id = EXCLUDED.run_id,"
    " rows_written = onceflow.sink_commits.rows_written + EXCLUDED.rows_written,"
    " committed_at = now()"
)


@dataclass(frozen=True)
class Marker:
    """The commit record of one window (or one restatement of it) in one sink."""

    job: str
    sink: str
    window_id: int
    restate_seq: int | None = None

    def epoch_of(self, conn: psycopg.Connection) -> int | None:
        """The epoch that wrote this marker (0 for a restatement's), or None if there is none."""
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
        *,
        exactly_once: bool,
    ) -> None:
        if self.restate_seq is not None:
            conn.execute(
                "INSERT INTO onceflow.restate_commits (job, sink, seq, xid, rows_written)"
                " VALUES (%s, %s, %s, pg_current_xact_id(), %s)",
                (self.job, self.sink, self.restate_seq, rows),
            )
            return
        conn.execute(
            _INSERT_MARKER if exactly_once else _UPSERT_MARKER,
            (self.job, self.sink, self.window_id, epoch, run_id, json.dumps(offsets), rows),
        )


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


class CopyWriter(PartitionWriter):
    """COPY one output's `columns` into the staging table `onceflow.<table>` on the executors.

    Each partition is one transaction. The CSV is spooled first (in memory up to
    SPOOL_IN_MEMORY_BYTES, then on local disk), so after a lost connection the executor decides
    by the transaction's id whether its COPY committed (a COMMIT whose answer was lost) and
    otherwise sends the spooled rows again, with backoff, for up to `retry_s` seconds (read on
    the driver from ONCEFLOW_PG_RETRY_S). The driver's count check on the staging table stays
    the authority.

    With `fence` (job, epoch), each COPY commits only while that epoch is the job's current
    one (read in the COPY's own transaction, in the round trip that asks its id): a run that
    was taken over (a zombie woken late, a stale task attempt) copies nothing.
    """

    window_fields = ("key", "table")

    def __init__(
        self,
        key: str,
        output: str,
        dsn: str,
        app_name: str,
        table: str,
        columns: Sequence[str],
        retry_s: float | None = None,
        fence: tuple[str, int] | None = None,
    ) -> None:
        self.key = key
        self.output = output
        self.dsn = dsn
        self.app_name = app_name
        self.table = table
        self.column_names = list(columns)
        self.retry_s = retry_deadline_s() if retry_s is None else retry_s
        self.fence = fence

    def columns(self, available: Sequence[str]) -> Sequence[str]:
        return self.column_names

    @property
    def positioned(self) -> bool:
        """Whether it copies the rows' positions (`staged_columns`)."""
        return all(c in self.column_names for c in POSITION)

    def open(self, partition: int) -> PartitionHandle:
        return _CopyHandle(self)


class _CopyHandle(PartitionHandle):
    def __init__(self, writer: CopyWriter) -> None:
        import tempfile

        import pyarrow.csv as pacsv

        self.writer = writer
        self.rows = 0
        self.options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
        self.spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES)

    def write(self, batch: pa.RecordBatch) -> None:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        table = _utc_as_text(pa.Table.from_batches([batch]).select(self.writer.column_names))
        buffer = io.BytesIO()
        pacsv.write_csv(table, buffer, self.options)
        self.spool.write(buffer.getvalue())
        self.rows += batch.num_rows

    def close(self) -> dict[str, Any]:
        if self.rows:
            self._copy()
        self.spool.close()
        return {"rows": self.rows}

    def _copy(self) -> None:
        w = self.writer
        statement = sql.SQL("COPY {}.{} ({}) FROM STDIN (FORMAT csv)").format(
            sql.Identifier("onceflow"),
            sql.Identifier(w.table),
            sql.SQL(", ").join(sql.Identifier(c) for c in w.column_names),
        )

        def connect() -> psycopg.Connection:
            return psycopg.connect(
                w.dsn, application_name=w.app_name, connect_timeout=CONNECT_TIMEOUT_S
            )

        # Kept by the worker from task to task (its next window's COPYs reuse them); an error
        # closes the session, so an attempt after a lost connection starts a new one.
        sessions = process_sessions(w.dsn)

        def copy_once(sent: list[str]) -> None:
            self.spool.seek(0)
            with sessions.session(application_name=w.app_name) as conn:
                with conn.cursor() as cur, cur.copy(statement) as copy:
                    while chunk := self.spool.read(1 << 20):
                        copy.write(chunk)
                if w.fence is None:
                    row = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
                else:
                    row = conn.execute(
                        "SELECT pg_current_xact_id()::text,"
                        " (SELECT epoch FROM onceflow.jobs WHERE job = %s)",
                        (w.fence[0],),
                    ).fetchone()
                assert row is not None
                if w.fence is not None and row[1] != w.fence[1]:
                    conn.rollback()
                    raise FencedError(
                        f"job {w.fence[0]!r}: this run (epoch {w.fence[1]}) was fenced by a newer "
                        f"run (epoch {row[1]}); its copy into {w.table} was not committed."
                    )
                sent.append(str(row[0]))  # from here on the COMMIT may apply unanswered
                conn.commit()

        def committed(xid: str) -> bool | None:
            """The fate of the transaction `xid` (None: still running)."""
            with connect() as conn:
                conn.autocommit = True
                row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
            status = row[0] if row else None
            return None if status == "in progress" else status == "committed"

        delays = None
        sent: list[str] = []  # the id of a transaction whose COMMIT got no answer
        while True:
            failure: Exception | None = None
            try:
                if not sent:
                    copy_once(sent)
                    return
                decided = committed(sent[-1])
                if decided:
                    return
                if decided is False:  # not applied: copy the spooled rows again
                    sent.clear()
                    continue
                failure = RuntimeError("the COPY's unanswered COMMIT stayed in progress")
            except Exception as exc:
                if not is_lost_connection(exc):
                    raise
                failure = exc
            delays = delays or retry_delays(w.retry_s)
            delay = delays()
            if delay is None:
                raise failure
            time.sleep(delay)


def _utc_as_text(table: pa.Table) -> pa.Table:
    """`table` with its UTC timestamp columns as the text the CSV writer would print for them
    ("2024-02-29 23:59:59.123456Z"), made at once: the writer converts each zoned timestamp to
    its zone on its own, about twenty times the cost of every other column of a row together.
    Timestamps of another zone are left to the writer, which prints their local time and offset.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    for i, field in enumerate(table.schema):
        kind = field.type
        if pa.types.is_timestamp(kind) and kind.tz == _UTC:
            wall = table.column(i).cast(pa.timestamp(kind.unit)).cast(pa.string())
            text = pc.binary_join_element_wise(wall, "Z", "")
            table = table.set_column(i, pa.field(field.name, pa.string()), text)
    return table


def staged_columns(spec: PostgresSink, available: Sequence[str]) -> list[str]:
    """The columns a sink's staging table takes from an output with `available` columns: the
    sink's, and for an `order_by` upsert the rows' positions where the output keeps them."""
    columns = list(spec.columns)
    if spec.order_by is not None and all(c in available for c in POSITION):
        columns += [c for c in POSITION if c not in columns]
    return columns


def copy_frame(
    dsn: str,
    app_name: str,
    table: str,
    columns: list[str],
    df: DataFrame,
    retry_s: float | None = None,
    fence: tuple[str, int] | None = None,
) -> int:
    """COPY `df`'s `columns` into `onceflow.<table>` on the executors; return the rows copied
    (as the executors report them: check the table's count against it, `lock_and_count`)."""
    writer = CopyWriter(table, "df", dsn, app_name, table, columns, retry_s, fence)
    return rows_written(run_writers({"df": df}, [writer])[writer.key])


def lock_and_count(
    conn: psycopg.Connection, table: sql.Composable, wait_s: float = STAGING_LOCK_WAIT_S
) -> int:
    """Inside `conn`'s transaction, lock `table` against writers and count its rows.

    Under READ COMMITTED each statement sees what committed before it began: a COPY committing
    between a count and the statement that applies the rows (a stale task attempt, a COPY whose
    COMMIT outlived ONCEFLOW_PG_RETRY_S and was sent again) would be applied uncounted. SHARE
    mode waits for a COPY under way (at most `wait_s`: then LockNotAvailable) and holds off
    every later one until the transaction ends, so the rows counted are the rows applied."""
    conn.execute(
        sql.SQL(
            "SET LOCAL lock_timeout = {}; LOCK TABLE {} IN SHARE MODE;"
            " SET LOCAL lock_timeout TO DEFAULT"
        ).format(sql.Literal(f"{int(wait_s * 1000)}ms"), table)
    )
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    return int(row[0]) if row else 0


def check_epoch_in(conn: psycopg.Connection, job: str, epoch: int) -> None:
    """Inside `conn`'s transaction: FencedError unless `epoch` is the job's current epoch.

    A read, not the commit's row lock (`Ledger.fence`): staging beside a commit under way must
    not wait for it."""
    row = conn.execute("SELECT epoch FROM onceflow.jobs WHERE job = %s", (job,)).fetchone()
    if row is None or int(row[0]) != epoch:
        raise FencedError(
            f"job {job!r}: this run (epoch {epoch}) was fenced by a newer run"
            f"{f' (epoch {row[0]})' if row else ''}; it stopped without writing."
        )


def _staging_name(job: str, sink: str, window_id: int, epoch: int, tag: str) -> str:
    digest = hashlib.sha1(f"{job}/{sink}/{window_id}/{epoch}/{tag}".encode()).hexdigest()[:20]
    return f"stage_{digest}"


class Transaction:
    """Commits one window (or one restatement) to several PostgreSQL sinks of one job at once."""

    def __init__(self, job: str, dsn: str, ledger: Ledger) -> None:
        self.job = job
        self._dsn = dsn
        self.ledger = ledger

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
            rows = rows_written(run_writers({spec.output: df}, [writer])[writer.key])
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
        retried with the same staging tables until ONCEFLOW_PG_RETRY_S.

        Raises:
            TransientSinkError: A staging table lost rows, or a lock wait timed out: stage
                again and retry.
            FencedError: A newer run took over.
            SinkError: PostgreSQL refused the window; nothing was written.
            PostgresUnavailableError: The server stayed unreachable.
        """
        what = f"commit window {window_id} to PostgreSQL" + (
            f" (restatement {restate_seq})" if restate_seq is not None else ""
        )
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
                    rows, added = _apply(
                        conn, item.spec, item.ident, self.job, window_id, item.positioned
                    )
                else:
                    rows, added = _restate(
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


# -- the SQL of each mode -----------------------------------------------------------------------


def _check_tables(conn: psycopg.Connection, job: str, specs: Sequence[PostgresSink]) -> None:
    """Inside the window's transaction: each sink's table is the one the ledger recorded (a
    table dropped and created again is another table, and the markers do not describe it)."""
    rows = conn.execute(
        "SELECT x.sink FROM unnest(%s::text[], %s::text[]) AS x(sink, qualified)"
        " JOIN onceflow.sink_tables t ON t.job = %s AND t.sink = x.sink"
        " WHERE to_regclass(x.qualified)::oid::text IS DISTINCT FROM t.identity",
        (
            [spec.name for spec in specs],
            [_target(spec).as_string(conn) for spec in specs],
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


def _target(spec: PostgresSink) -> sql.Identifier:
    return sql.Identifier(spec.schema, spec.table)


def _keys_match(spec: PostgresSink, left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{}.{} = {}.{}").format(
            sql.Identifier(left), sql.Identifier(k), sql.Identifier(right), sql.Identifier(k)
        )
        for k in spec.key
    )


def _apply(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    positioned: bool = False,
) -> tuple[int, int]:
    """Move the staged rows into the sink's table; return the rows written and added.

    `positioned`: the staging table holds the rows' `POSITION` columns too."""
    if spec.mode == "accumulate":
        _forget_contribution(conn, spec, job, window_id)
        return _accumulate(conn, spec, _summed(spec, staging), record=(job, window_id))
    cols = list(spec.columns)
    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
    target = _target(spec)
    if spec.mode == "append":
        rows = conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                target, col_list, col_list, staging
            )
        ).rowcount
        return rows, rows
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    if spec.order_by is None:
        _check_one_row_per_key(conn, spec, staging, job, window_id)
        rows = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(col_list, staging, keys)
    else:
        # One row per key: the greatest `order_by`, a tie to the later position.
        order = _latest_first(spec, positioned)
        _check_no_tie(conn, spec, staging, job, window_id, order, positioned)
        rows = sql.SQL("SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {}, {}").format(
            keys, col_list, staging, keys, order
        )
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
    later_window: sql.Composable = sql.SQL("true")
    if spec.window_column is not None:
        # The row of the latest window wins, also when an earlier window is restated (or
        # replayed) after a later one updated the same key.
        later_window = sql.SQL("COALESCE(t.{} <= EXCLUDED.{}, true)").format(
            sql.Identifier(spec.window_column), sql.Identifier(spec.window_column)
        )
    if others and spec.order_by is not None:
        # The greater `order_by` wins whichever window brings it (a late event never replaces
        # a newer row; a null is the least); on a tie, the later window.
        ob = sql.Identifier(spec.order_by)
        action = sql.SQL(
            "{} WHERE CASE WHEN EXCLUDED.{} IS NOT DISTINCT FROM t.{} THEN {}"
            " ELSE COALESCE(EXCLUDED.{} > t.{}, EXCLUDED.{} IS NOT NULL) END"
        ).format(action, ob, ob, later_window, ob, ob, ob)
    elif others and spec.window_column is not None:
        action = sql.SQL("{} WHERE {}").format(action, later_window)
    # xmax = 0 marks a row this statement inserted rather than replaced. In key order, the
    # index is walked page after page rather than at random (a sixth less time, measured).
    row = conn.execute(
        sql.SQL(
            "WITH w AS (INSERT INTO {} AS t ({}) {}"
            " ON CONFLICT ({}) {} RETURNING (xmax = 0) AS inserted)"
            " SELECT count(*), count(*) FILTER (WHERE inserted) FROM w"
        ).format(target, col_list, rows, keys, action)
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _check_one_row_per_key(
    conn: psycopg.Connection, spec: PostgresSink, staging: sql.Composable, job: str, window_id: int
) -> None:
    """An upsert takes one row per key from a window; two would leave the winner to chance."""
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    row = conn.execute(
        sql.SQL("SELECT count(*) - count(DISTINCT ({})) FROM {}").format(keys, staging)
    ).fetchone()
    extra = int(row[0]) if row else 0
    if extra:
        raise SinkError(
            f"sink {spec.name}: window {window_id}'s output `{spec.output}` has {extra} more "
            f"row(s) than keys {list(spec.key)}; an upsert sink takes one row per key per window. "
            "Nothing was written. Keep one row per key in the transform (or dedupe the job by "
            "that key), or let the sink pick one (`order_by=` a column: the greatest wins); "
            f"then `onceflow windows recompute {job} {window_id}` and run the job again."
        )


def _latest_first(spec: PostgresSink, positioned: bool) -> sql.Composable:
    """The ORDER BY that puts an `order_by` upsert's winning row of a key first."""
    assert spec.order_by is not None
    terms = [sql.SQL("{} DESC NULLS LAST").format(sql.Identifier(spec.order_by))]
    if positioned:
        terms += [sql.SQL("{} DESC NULLS LAST").format(sql.Identifier(c)) for c in POSITION]
    return sql.SQL(", ").join(terms)


def _check_no_tie(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    order: sql.Composable,
    positioned: bool,
) -> None:
    """Rows of one key that differ yet rank first together would leave the winner to chance."""
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    rows = conn.execute(
        sql.SQL(
            "SELECT {} FROM (SELECT *, rank() OVER (PARTITION BY {} ORDER BY {}) AS __rank"
            " FROM {}) AS s WHERE __rank = 1 GROUP BY {}"
            " HAVING count(DISTINCT ROW({})) > 1 LIMIT 5"
        ).format(
            keys,
            keys,
            order,
            staging,
            keys,
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns),
        )
    ).fetchall()
    if rows:
        named = "; ".join(
            ", ".join(f"{k}={v}" for k, v in zip(spec.key, r, strict=True)) for r in rows
        )
        place = (
            "the same position"
            if positioned
            else "no position (the output lacks `_file_idx` and `_source_line`)"
        )
        raise SinkError(
            f"sink {spec.name}: window {window_id}'s output `{spec.output}` has rows of one key "
            f"that differ with the same {spec.order_by} and {place}: {named}; nothing was "
            f"written. Keep `_file_idx` and `_source_line` in the output (the later record then "
            f"wins), or make {spec.order_by} tell the rows apart; then "
            f"`onceflow windows recompute {job} {window_id}` and run the job again."
        )


def _summed(spec: PostgresSink, rows: sql.Composable) -> sql.Composable:
    """`rows` (a relation with the sink's columns) summed by key: one row per key.

    UPDATE … FROM uses only one of several matching rows, so an accumulating window must reach
    the table with each key once.
    """
    others = [c for c in spec.columns if c not in spec.key and c not in spec.accumulate]
    return sql.SQL("(SELECT {} FROM {} AS r GROUP BY {})").format(
        sql.SQL(", ").join(
            [
                *(sql.Identifier(k) for k in spec.key),
                *(
                    sql.SQL("sum({}::numeric) AS {}").format(sql.Identifier(c), sql.Identifier(c))
                    for c in spec.accumulate
                ),
                *(
                    sql.SQL("max({}) AS {}").format(sql.Identifier(c), sql.Identifier(c))
                    for c in others
                ),
            ]
        ),
        rows,
        sql.SQL(", ").join(sql.Identifier(k) for k in spec.key),
    )


def _accumulate(
    conn: psycopg.Connection,
    spec: PostgresSink,
    delta: sql.Composable,
    *,
    record: tuple[str, int] | None = None,
) -> tuple[int, int]:
    """Add `delta` (one row per key, numeric amounts) into the table; drop rows back at zero.

    `record`: the (job, window id) whose contribution `delta` is, recorded in the same pass
    (the window's earlier record forgotten first, by the caller).

    Returns the rows written and the rows the table gained (inserted minus deleted)."""
    if _key_is_unique(conn, spec):
        # A window's sum alone may be past the column's range while the total is not (amounts
        # of both signs): the upsert cannot add it in numeric, the two statements below can.
        conn.execute("SAVEPOINT onceflow_accumulate")
        try:
            done = _accumulate_upsert(conn, spec, delta, record)
        except psycopg.errors.NumericValueOutOfRange:
            conn.execute("ROLLBACK TO SAVEPOINT onceflow_accumulate")
        else:
            conn.execute("RELEASE SAVEPOINT onceflow_accumulate")
            return done
    if record is not None:
        conn.execute(_record_contribution(spec, *record, delta))
    target = _target(spec)
    sets = [
        sql.SQL("{} = (t.{}::numeric + s.{})::{}").format(
            sql.Identifier(c), sql.Identifier(c), sql.Identifier(c), sql.SQL(spec.columns[c])
        )
        for c in spec.accumulate
    ]
    others = [c for c in spec.columns if c not in spec.key and c not in spec.accumulate]
    sets += [sql.SQL("{} = s.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in others]
    match = _keys_match(spec, "t", "s")
    conn.execute(
        sql.SQL("CREATE TEMP TABLE __delta ON COMMIT DROP AS SELECT * FROM {}").format(delta)
    )
    updated = conn.execute(
        sql.SQL("UPDATE {} AS t SET {} FROM __delta AS s WHERE {}").format(
            target, sql.SQL(", ").join(sets), match
        )
    ).rowcount
    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns)
    inserted = conn.execute(
        sql.SQL(
            "INSERT INTO {} ({}) SELECT {} FROM __delta AS s"
            " WHERE NOT EXISTS (SELECT 1 FROM {} AS t WHERE {})"
        ).format(target, col_list, _cast_columns(spec), target, match)
    ).rowcount
    deleted = _delete_emptied(conn, spec, sql.SQL("__delta"))
    conn.execute("DROP TABLE __delta")
    return updated + inserted, inserted - deleted


def _cast_columns(spec: PostgresSink) -> sql.Composable:
    """The columns of the relation `s` cast to the table's types, in table order."""
    return sql.SQL(", ").join(
        sql.SQL("s.{}::{}").format(sql.Identifier(c), sql.SQL(t)) for c, t in spec.columns.items()
    )


def _delete_emptied(conn: psycopg.Connection, spec: PostgresSink, delta: sql.Composable) -> int:
    """Delete the rows of `delta`'s keys whose accumulated columns all came back to zero."""
    # Such a row holds nothing (every payment of a day retracted): it goes, so the table equals
    # the sums over what is there.
    return conn.execute(
        sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {} AND {}").format(
            _target(spec),
            delta,
            _keys_match(spec, "t", "s"),
            sql.SQL(" AND ").join(
                sql.SQL("t.{} = 0").format(sql.Identifier(c)) for c in spec.accumulate
            ),
        )
    ).rowcount


def _key_is_unique(conn: psycopg.Connection, spec: PostgresSink) -> bool:
    """Whether the sink's table has a unique index on exactly its key that `ON CONFLICT` can
    use: valid, not partial, not on expressions, not deferred. Tables onceflow creates have one
    (their primary key); a table a user made may not."""
    row = conn.execute(
        """
        SELECT EXISTS (
            SELECT 1 FROM pg_index AS i
             WHERE i.indrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))
               AND i.indisunique AND i.indisvalid AND i.indimmediate
               AND i.indpred IS NULL AND i.indexprs IS NULL
               AND i.indnatts = cardinality(%s::text[])
               AND (SELECT array_agg(a.attname::text ORDER BY a.attname::text)
                      FROM pg_attribute AS a
                     WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey))
                   = (SELECT array_agg(k ORDER BY k) FROM unnest(%s::text[]) AS k))
        """,
        (spec.schema, spec.table, list(spec.key), list(spec.key)),
    ).fetchone()
    return bool(row and row[0])


def _accumulate_upsert(
    conn: psycopg.Connection,
    spec: PostgresSink,
    delta: sql.Composable,
    record: tuple[str, int] | None = None,
) -> tuple[int, int]:
    """`_accumulate` in one pass over the key's unique index: one `INSERT … ON CONFLICT DO
    UPDATE` instead of a temporary table, an update and an insert of the keys not there; with
    `record`, the contribution is inserted by the same statement, from the same sums (the
    staged rows are grouped once).

    The window's sum enters as the column's type (the proposed row) before it is added, so a
    sum past the column's range fails here (NumericValueOutOfRange) even where the total would
    fit; `_accumulate` then adds it the other way, in numeric."""
    target = _target(spec)
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    sets = [
        sql.SQL("{} = (t.{}::numeric + EXCLUDED.{}::numeric)::{}").format(
            sql.Identifier(c), sql.Identifier(c), sql.Identifier(c), sql.SQL(spec.columns[c])
        )
        for c in spec.accumulate
    ]
    sets += [
        sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
        for c in spec.columns
        if c not in spec.key and c not in spec.accumulate
    ]
    zero = sql.SQL(" AND ").join(
        sql.SQL("{} = 0").format(sql.Identifier(c)) for c in spec.accumulate
    )
    # A data-modifying CTE runs whether or not the query reads it.
    recorded = (
        sql.SQL(", c AS ({})").format(_record_contribution(spec, *record, sql.SQL("s")))
        if record is not None
        else sql.SQL("")
    )
    row = conn.execute(
        sql.SQL(
            "WITH s AS MATERIALIZED {}{},"
            " w AS (INSERT INTO {} AS t ({}) SELECT {} FROM s ORDER BY {}"
            " ON CONFLICT ({}) DO UPDATE SET {}"
            " RETURNING (xmax = 0) AS inserted, ({}) AS emptied)"
            " SELECT count(*), count(*) FILTER (WHERE inserted),"
            " count(*) FILTER (WHERE emptied) FROM w"
        ).format(
            delta,
            recorded,
            target,
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns),
            _cast_columns(spec),
            sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(k)) for k in spec.key),
            keys,
            sql.SQL(", ").join(sets),
            zero,
        )
    ).fetchone()
    assert row is not None
    written, inserted, emptied = (int(v) for v in row)
    # Rare (every amount of a key retracted): the delta is read again to find its keys.
    deleted = _delete_emptied(conn, spec, delta) if emptied else 0
    return written, inserted - deleted


def _contribution(spec: PostgresSink, job: str, window_id: int) -> sql.Composable:
    """The recorded contribution of a window to an accumulating sink, as a relation: the key
    columns (as the table's types) and the summed amounts (numeric), one row per key."""
    where = sql.SQL("c.job = {} AND c.sink = {} AND c.window_id = {}").format(
        sql.Literal(job), sql.Literal(spec.name), sql.Literal(window_id)
    )
    # Keys were stored as text that casts back exactly (`_key_text`).
    typed = [
        sql.SQL("{}::{} AS {}").format(
            sql.Identifier(f"k{i}"), sql.SQL(spec.columns[k]), sql.Identifier(k)
        )
        for i, k in enumerate(spec.key)
    ]
    typed += [
        sql.SQL("{} AS {}").format(sql.Identifier(f"a{i}"), sql.Identifier(a))
        for i, a in enumerate(spec.accumulate)
    ]
    # `keys[c:c]` is column c's values in key order; unnest zips the columns back into rows.
    slices = [sql.SQL("c.keys[{0}:{0}]").format(sql.Literal(i + 1)) for i in range(len(spec.key))]
    slices += [
        sql.SQL("c.amounts[{0}:{0}]").format(sql.Literal(i + 1))
        for i in range(len(spec.accumulate))
    ]
    names = [sql.Identifier(f"k{i}") for i in range(len(spec.key))]
    names += [sql.Identifier(f"a{i}") for i in range(len(spec.accumulate))]
    legacy = [
        sql.SQL("(c.key ->> {})::{} AS {}").format(
            sql.Literal(i), sql.SQL(spec.columns[k]), sql.Identifier(k)
        )
        for i, k in enumerate(spec.key)
    ]
    legacy += [
        sql.SQL("(c.amounts ->> {})::numeric AS {}").format(sql.Literal(i), sql.Identifier(a))
        for i, a in enumerate(spec.accumulate)
    ]
    return sql.SQL(
        "(SELECT {typed} FROM onceflow.window_contributions AS c, unnest({slices}) AS u({names})"
        " WHERE {where}"
        " UNION ALL SELECT {legacy} FROM onceflow.contributions AS c WHERE {where})"
    ).format(
        typed=sql.SQL(", ").join(typed),
        slices=sql.SQL(", ").join(slices),
        names=sql.SQL(", ").join(names),
        where=where,
        legacy=sql.SQL(", ").join(legacy),
    )


def _forget_contribution(
    conn: psycopg.Connection, spec: PostgresSink, job: str, window_id: int
) -> None:
    for table in ("window_contributions", "contributions"):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE job = %s AND sink = %s AND window_id = %s").format(
                sql.Identifier("onceflow", table)
            ),
            (job, spec.name, window_id),
        )


def _key_text(spec: PostgresSink, column: str) -> sql.Composable:
    """A key column's value as text that casts back to it exactly: its JSON text, which no
    session setting (DateStyle, TimeZone) changes; a text column as it is."""
    if spec.columns[column].strip().lower() == "text":
        return sql.Identifier(column)
    return sql.SQL("to_jsonb({}) #>> '{{}}'").format(sql.Identifier(column))


def _save_contribution(
    conn: psycopg.Connection, spec: PostgresSink, staging: sql.Composable, job: str, window_id: int
) -> None:
    """Record what the window adds to an accumulating sink, in the commit's own transaction.

    A window that adds nothing records no row (`has_contribution` then reads its marker)."""
    _forget_contribution(conn, spec, job, window_id)
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    grouped = sql.SQL("(SELECT {}, {} FROM {} AS r GROUP BY {})").format(
        keys,
        sql.SQL(", ").join(
            sql.SQL("sum({}::numeric) AS {}").format(sql.Identifier(a), sql.Identifier(a))
            for a in spec.accumulate
        ),
        staging,
        keys,
    )
    conn.execute(_record_contribution(spec, job, window_id, grouped))


def _record_contribution(
    spec: PostgresSink, job: str, window_id: int, sums: sql.Composable
) -> sql.Composable:
    """The insert of a window's contribution row from `sums` (a relation with one row per key:
    the key columns and the accumulated columns summed as numeric)."""
    return sql.SQL(
        "INSERT INTO onceflow.window_contributions (job, sink, window_id, keys, amounts)"
        " SELECT {}, {}, {}, ARRAY[{}], ARRAY[{}] FROM {} AS g HAVING count(*) > 0"
    ).format(
        sql.Literal(job),
        sql.Literal(spec.name),
        sql.Literal(window_id),
        sql.SQL(", ").join(sql.SQL("array_agg({})").format(_key_text(spec, k)) for k in spec.key),
        sql.SQL(", ").join(
            sql.SQL("array_agg({})").format(sql.Identifier(a)) for a in spec.accumulate
        ),
        sums,
    )


def has_contribution(conn: psycopg.Connection, job: str, sink: str, window_id: int) -> bool:
    """Whether the window's contribution to an accumulating sink is on record."""
    return (
        conn.execute(
            "SELECT 1 FROM onceflow.window_contributions"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s"
            " UNION ALL SELECT 1 FROM onceflow.contributions"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s"
            " UNION ALL SELECT 1 FROM onceflow.sink_commits"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s AND rows_written = 0"
            " LIMIT 1",
            {"job": job, "sink": sink, "w": window_id},
        ).fetchone()
        is not None
    )


def _restate(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    positioned: bool = False,
) -> tuple[int, int]:
    """Replace the window's effect in the sink by the staged rows; return the rows written and
    the table's net change in rows."""
    if spec.mode == "accumulate":
        new = sql.SQL("(SELECT {} FROM {} AS n)").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns), staging
        )
        old = _contribution(spec, job, window_id)
        negated = sql.SQL("(SELECT {} FROM {} AS o)").format(
            sql.SQL(", ").join(
                [
                    *(sql.Identifier(k) for k in spec.key),
                    *(sql.SQL("-{}").format(sql.Identifier(a)) for a in spec.accumulate),
                    *(
                        sql.SQL("NULL::{}").format(sql.SQL(spec.columns[c]))
                        for c in spec.columns
                        if c not in spec.key and c not in spec.accumulate
                    ),
                ]
            ),
            old,
        )
        ordered = [*spec.key, *spec.accumulate]
        ordered += [c for c in spec.columns if c not in ordered]
        both = sql.SQL("(SELECT {} FROM {} AS n UNION ALL SELECT * FROM {} AS o)").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in ordered), new, negated
        )
        rows = _accumulate(conn, spec, _summed(spec, both))
        _save_contribution(conn, spec, staging, job, window_id)
        return rows
    assert spec.window_column is not None  # checked by the group before any change
    where = sql.SQL("{} = {}").format(sql.Identifier(spec.window_column), sql.Literal(window_id))
    if spec.job_column is not None:
        where = sql.SQL("{} AND {} = {}").format(
            where, sql.Identifier(spec.job_column), sql.Literal(job)
        )
    deleted = conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(_target(spec), where)).rowcount
    rows, added = _apply(conn, spec, staging, job, window_id, positioned)
    return rows, added - deleted
