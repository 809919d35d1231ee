"""COPY into PostgreSQL from Spark's executors, the one way every part of the platform stages rows
(the PostgreSQL sinks' staging tables, the key index's staged keys): each partition one
spooled, fenced COPY transaction, sent again after a lost connection unless it committed;
the count check on the driver (`lock_and_count`) stays the authority.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow.errors import (
    FencedError,
)
from onceflow.postgres import (
    CONNECT_TIMEOUT_S,
    is_lost_connection,
    process_sessions,
    retry_deadline_s,
    retry_delays,
)
from onceflow.sinks.writers import PartitionHandle, PartitionWriter, rows_written, run_writers

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame


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
    return rows_written(run_writers({"df": df}, [writer]).written[writer.key])


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
