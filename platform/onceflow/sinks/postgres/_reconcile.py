"""Reconcile a PostgreSQL sink: read it on Spark, diff it, repair it in one fenced transaction.

Reading without a JDBC driver: executors read the table with psycopg, each a range of the
table's blocks (`ctid` TID range scans, PostgreSQL 14+), all under one snapshot exported by the
driver's transaction. Chosen over COPY TO STDOUT into Parquet because that funnels every row
through the driver and a temporary copy; here each block is read once, by one executor, no row
reaches the driver, and the exported snapshot gives all executors the same consistent view.
In a repair, the driver's transaction first fences (epoch) and locks the table against writers
(readers still pass), so the table cannot change between the snapshot the diff saw and the
DELETE/INSERT that repairs it; both happen in that one transaction. The rows to delete and to
insert reach it through staging tables that the executors COPY into; each is locked and counted
against what the executors reported before it is applied (a retried task's COPY that committed
twice is staged again, never applied).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from onceflow import faults
from onceflow._diff import Diff, multiset_diff
from onceflow._identifiers import session_name
from onceflow._pgcopy import copy_frame, lock_and_count
from onceflow.errors import CommitUnknownError, SinkError, TransientSinkError
from onceflow.postgres import connect, is_lost_connection, retrying
from onceflow.sinks.postgres.spec import PostgresSink, arrow_type, spark_schema
from onceflow.storage import Location

if TYPE_CHECKING:
    from onceflow.ledger import Ledger

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

_log = logging.getLogger(__name__)

# Narrows (expected, actual) to the rows a reconcile compares.
Narrow = Callable[["DataFrame", "DataFrame"], tuple["DataFrame", "DataFrame"]]

# Rows an executor fetches from its server-side cursor at a time.
_FETCH_ROWS = 10_000
# Times an executor reads one block range over a lost connection before its task fails.
_RANGE_ATTEMPTS = 5
# Times a repair's rows are staged before the repair is refused.
REPAIR_STAGE_ATTEMPTS = 3
# The highest block number a tid can name: the last range is open-ended.
_MAX_BLOCK = 4_294_967_295


def _read_ranges(
    dsn: str, app_name: str, snapshot: str, query: str, columns: dict[str, str]
) -> Any:
    """A mapInArrow function: read each (lo, hi) block range of the table under `snapshot`.

    A range whose connection is lost is read again on a new connection under the same snapshot
    (its rows are yielded only once it was read whole), so one lost reply costs a range, not
    the whole read; the driver's read is done again only if the snapshot itself is gone."""
    names = list(columns)
    types = [arrow_type(t) for t in columns.values()]

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import time

        import psycopg
        import pyarrow as pa
        from psycopg import sql

        schema = pa.schema(list(zip(names, types, strict=True)))
        conn: psycopg.Connection | None = None
        snapshot_gone = False  # its exporting transaction ended: reading again cannot help

        def connect_under_snapshot() -> psycopg.Connection:
            nonlocal snapshot_gone
            new = psycopg.connect(dsn, application_name=app_name)
            new.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            new.read_only = True
            try:
                new.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            except psycopg.Error as exc:
                new.close()
                if is_lost_connection(exc):
                    raise
                # The exporting transaction ended (the driver lost its connection): the
                # driver reads again under a new snapshot.
                snapshot_gone = True
                raise psycopg.OperationalError(
                    f"the read's snapshot is gone: {type(exc).__name__}"
                ) from None
            return new

        def read(lo: int, hi: int) -> list[pa.RecordBatch]:
            nonlocal conn
            delay = 0.1
            for attempt in range(1, _RANGE_ATTEMPTS + 1):
                try:
                    if conn is None:
                        conn = connect_under_snapshot()
                    out = []
                    with conn.cursor(name=f"reconcile_{uuid.uuid4().hex[:8]}") as cur:
                        cur.execute(query.encode(), {"lo": f"({lo},0)", "hi": f"({hi},0)"})
                        while rows := cur.fetchmany(_FETCH_ROWS):
                            out.append(
                                pa.RecordBatch.from_arrays(
                                    [
                                        pa.array([r[i] for r in rows], type=t)
                                        for i, t in enumerate(types)
                                    ],
                                    schema=schema,
                                )
                            )
                    return out
                except psycopg.Error as exc:
                    if conn is not None:
                        conn.close()
                        conn = None
                    if snapshot_gone or attempt == _RANGE_ATTEMPTS or not is_lost_connection(exc):
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
            raise AssertionError("unreachable")

        try:
            for batch in batches:
                for lo, hi in zip(
                    batch.column("lo").to_pylist(), batch.column("hi").to_pylist(), strict=True
                ):
                    yield from read(lo, hi)
        finally:
            if conn is not None:
                conn.close()

    return run


def read_postgres(
    spark: SparkSession,
    dsn: str,
    conn: psycopg.Connection,
    spec: PostgresSink,
    *,
    job_filter: str | None = None,
    rows_after: tuple[str, int] | None = None,
) -> DataFrame:
    """The sink's table as a DataFrame, read by the executors under `conn`'s snapshot.

    `conn` must be inside a transaction that stays open until the DataFrame has been used;
    the data is the table as of the moment of this call.

    Args:
        spark: The Spark session.
        dsn: The DSN, handed to the executors (never logged).
        conn: The driver's open transaction, whose snapshot the executors import.
        spec: The sink.
        job_filter: Only rows whose job column equals this (tables shared by jobs).
        rows_after: (column, value): only rows whose column is null or above the value (the
            server filters them: the rows of windows verified before are not sent).
    """
    row = conn.execute("SELECT pg_export_snapshot()").fetchone()
    assert row is not None
    snapshot = str(row[0])
    row = conn.execute(
        "SELECT pg_relation_size(to_regclass(format('%%I.%%I', %s::text, %s::text)))"
        " / current_setting('block_size')::bigint",
        (spec.schema, spec.table),
    ).fetchone()
    blocks = int(row[0]) if row and row[0] is not None else 0
    parallelism = int(spark.conf.get("spark.sql.shuffle.partitions", "4") or 4)
    ranges = max(1, min(parallelism, blocks))
    step = -(-max(blocks, 1) // ranges)
    bounds = [(i * step, (i + 1) * step) for i in range(ranges)]
    bounds[-1] = (bounds[-1][0], _MAX_BLOCK)
    select = [
        sql.SQL("{}::numeric(38,18)").format(sql.Identifier(c))
        if t == "numeric"
        else sql.Identifier(c)
        for c, t in spec.columns.items()
    ]
    where = sql.SQL("ctid >= %(lo)s::tid AND ctid < %(hi)s::tid")
    if job_filter is not None and spec.job_column is not None:
        where = sql.SQL("{} AND {} = {}").format(
            where, sql.Identifier(spec.job_column), sql.Literal(job_filter)
        )
    if rows_after is not None:
        column, value = rows_after
        where = sql.SQL("{} AND ({} IS NULL OR {} > {})").format(
            where, sql.Identifier(column), sql.Identifier(column), sql.Literal(value)
        )
    query = (
        sql.SQL("SELECT {} FROM {} WHERE {}")
        .format(sql.SQL(", ").join(select), sql.Identifier(spec.schema, spec.table), where)
        .as_string(conn)
    )
    reader = _read_ranges(dsn, "onceflow/reconcile-read", snapshot, query, dict(spec.columns))
    specs = spark.createDataFrame(bounds, "lo BIGINT, hi BIGINT").repartition(len(bounds))
    return specs.mapInArrow(reader, spark_schema(dict(spec.columns)))


def reconcile_postgres(
    spark: SparkSession,
    dsn: str,
    ledger: Ledger,
    job: str,
    spec: PostgresSink,
    expected: DataFrame,
    *,
    narrow: Narrow,
    key: Sequence[str],
    workdir: Location,
    epoch: int | None,
    job_filter: str | None = None,
    rows_after: tuple[str, int] | None = None,
) -> Diff:
    """Diff the sink with `expected`; when `epoch` is given, repair it in one transaction.

    A connection lost on the driver is survived by doing the whole again (until
    ONCEFLOW_PG_RETRY_S): before the repair's COMMIT nothing changed; after an unanswered
    COMMIT the new diff decides: empty means the repair applied, else it is repaired now.

    Args:
        spark: The Spark session.
        dsn: The DSN.
        ledger: The job's ledger (fencing).
        job: The job's name.
        spec: The sink.
        expected: The expected rows, with the sink's columns and types.
        narrow: Narrows (expected, actual) to the rows under comparison.
        key: Match columns (the sink's key), or empty for whole rows.
        workdir: A folder for the diff.
        epoch: The reconcile's epoch; None for a dry run.
        job_filter: Only compare rows whose job column is this.
        rows_after: Only read rows whose column is null or above the value (`read_postgres`):
            for a `narrow` that keeps no other row.
    """
    unanswered: list[Diff] = []  # a repair whose COMMIT got no answer
    attempts = 0

    def attempt() -> Diff:
        nonlocal attempts
        attempts += 1
        # Each attempt writes its own diff: an unanswered repair's diff is still read (for
        # its report) after a later attempt has compared again.
        try:
            diff = _reconcile_once(
                spark, dsn, ledger, job, spec, expected, narrow=narrow, key=key,
                workdir=workdir / f"attempt{attempts}", epoch=epoch, job_filter=job_filter,
                rows_after=rows_after,
            )  # fmt: skip
        except _RepairUnanswered as lost:
            unanswered.append(lost.diff)
            raise lost.error from None
        except Exception as exc:
            # An executor that lost its connection while reading fails the Spark job; the read
            # is done again like any other.
            if not isinstance(exc, psycopg.Error) and "psycopg.OperationalError" in str(exc):
                raise psycopg.OperationalError(
                    "an executor lost its connection while reading the sink"
                ) from exc
            raise
        if unanswered and diff.empty:
            return unanswered[0]  # the unanswered repair had applied
        return diff

    return retrying(attempt, what=f"reconcile sink {spec.name} (job {job})", dsn=dsn)


class _RepairUnanswered(Exception):
    def __init__(self, diff: Diff, error: Exception) -> None:
        super().__init__(str(error))
        self.diff = diff
        self.error = error


def _reconcile_once(
    spark: SparkSession,
    dsn: str,
    ledger: Ledger,
    job: str,
    spec: PostgresSink,
    expected: DataFrame,
    *,
    narrow: Narrow,
    key: Sequence[str],
    workdir: Location,
    epoch: int | None,
    job_filter: str | None,
    rows_after: tuple[str, int] | None,
) -> Diff:
    columns = list(spec.columns)
    target = sql.Identifier(spec.schema, spec.table)
    repair = epoch is not None
    # The diff can outlast the ledger's idle-in-transaction limit; a frozen reconcile is still
    # ended by the next run, which terminates sessions of older epochs.
    conn = connect(
        dsn,
        application_name=session_name(job, epoch) if repair else "onceflow",
        settings={"idle_in_transaction_session_timeout": "0"},
    )
    staged: list[str] = []  # every staging table the repair made, dropped at the end
    try:
        if repair:
            assert epoch is not None
            conn.execute("SET LOCAL synchronous_commit = on")
            ledger.fence(conn, epoch)
            conn.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(target))
        else:
            conn.read_only = True
        expected, actual = narrow(
            expected,
            read_postgres(spark, dsn, conn, spec, job_filter=job_filter, rows_after=rows_after),
        )
        diff = multiset_diff(expected.select(*columns), actual.select(*columns), columns, key,
                             workdir / f"diff_{spec.name}")  # fmt: skip
        if not repair or diff.empty:
            conn.rollback()
            return diff
        assert epoch is not None
        try:
            conn.execute("SAVEPOINT onceflow_repair")
            _apply(dsn, conn, job, spec, diff, epoch, staged, keyed=bool(key))
        except psycopg.OperationalError as exc:
            if is_lost_connection(exc):
                raise  # nothing was changed: done again
            raise TransientSinkError(
                f"sink {spec.name}: the connection broke during the repair; nothing was "
                "changed. Run reconcile again."
            ) from None
        except psycopg.Error as exc:
            # The server's DETAIL quotes row values: say why by the constraint and the keys.
            why = _refused_by(conn, spec, exc, staged)
            raise SinkError(
                f"sink {spec.name}: PostgreSQL refused the repair ({type(exc).__name__}, SQLSTATE "
                f"{exc.sqlstate}){why}; nothing was changed. A constraint beyond the sink's key "
                "(added outside onceflow) must allow the job's rows: correct it, or the rows it "
                f"names, then run `onceflow reconcile {job}` again (`--dry-run` names the keys "
                "that differ)."
            ) from None
        try:
            conn.commit()
        except psycopg.OperationalError as exc:
            if is_lost_connection(exc):
                raise _RepairUnanswered(diff, exc) from None
            raise CommitUnknownError(
                f"sink {spec.name}: the repair's COMMIT got no answer; run reconcile again "
                "(with --dry-run) to see whether it applied."
            ) from None
        return diff
    finally:
        conn.close()
        _drop(dsn, staged)


def _apply(
    dsn: str,
    conn: psycopg.Connection,
    job: str,
    spec: PostgresSink,
    diff: Diff,
    epoch: int,
    names: list[str],
    *,
    keyed: bool,
) -> None:
    """Inside `conn`'s transaction: delete the differing rows, insert the expected ones.

    The rows go through staging tables (recorded in `names`; the caller drops them once the
    transaction has ended: dropping them earlier would wait on this transaction's locks).

    Raises:
        TransientSinkError: The staging tables never held what the executors reported.
    """
    target = sql.Identifier(spec.schema, spec.table)
    match = diff.match
    columns = [*diff.match, *diff.values]
    for attempt in range(REPAIR_STAGE_ATTEMPTS):
        del_name, ins_name = _staging_names(job, spec, epoch, attempt)
        names += [del_name, ins_name]
        if _stage(dsn, conn, job, spec, epoch, [(del_name, match), (ins_name, columns)], diff):
            break
    else:
        raise TransientSinkError(
            f"sink {spec.name}: the repair's staging tables never held exactly the rows the "
            f"executors copied ({REPAIR_STAGE_ATTEMPTS} attempts); nothing was changed. Run "
            f"`onceflow reconcile {job}` again."
        )
    # Keys are NOT NULL, so `=` (which can use the key's index); whole rows may hold nulls.
    equal = "t.{} = s.{}" if keyed else "t.{} IS NOT DISTINCT FROM s.{}"
    condition = sql.SQL(" AND ").join(
        sql.SQL(equal).format(sql.Identifier(c), sql.Identifier(c)) for c in match
    )
    conn.execute(
        sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {}").format(
            target, sql.Identifier("onceflow", del_name), condition
        )
    )
    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    conn.execute(
        sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
            target, col_list, col_list, sql.Identifier("onceflow", ins_name)
        )
    )


def _stage(
    dsn: str,
    conn: psycopg.Connection,
    job: str,
    spec: PostgresSink,
    epoch: int,
    tables: list[tuple[str, list[str]]],
    diff: Diff,
) -> bool:
    """Create the (delete, insert) staging tables, have the executors COPY the diff's rows
    into them, then lock and count them in `conn`'s transaction: True when each holds exactly
    what the executors reported (and will until the transaction ends)."""
    app = session_name(job, epoch)
    with connect(dsn, autocommit=True, application_name=app) as ddl:
        for name, cols in tables:
            table = sql.Identifier("onceflow", name)
            ddl.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
            ddl.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} ({})").format(
                    table,
                    sql.SQL(", ").join(
                        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(spec.columns[c]))
                        for c in cols
                    ),
                )
            )
    copied = [
        copy_frame(dsn, app, name, cols, rows, fence=(job, epoch))
        for (name, cols), rows in zip(tables, (diff.deletes(), diff.inserts()), strict=True)
    ]
    faults.point("repair_staged")
    held: list[int | None] = []
    for name, _ in tables:
        conn.execute("SAVEPOINT onceflow_repair_staged")
        try:
            held.append(lock_and_count(conn, sql.Identifier("onceflow", name)))
        except psycopg.errors.LockNotAvailable:  # a copy still under way into it
            conn.execute("ROLLBACK TO SAVEPOINT onceflow_repair_staged")
            held.append(None)
    if held == copied:
        return True
    # A task retried after its COPY had committed (or a COPY whose answer was lost and was
    # sent again) staged rows no executor reported: stage the repair again, in new tables.
    _log.warning(
        "sink %s: the repair's staging tables hold %s rows, the executors copied %s; staging again",
        spec.name,
        held,
        copied,
    )
    return False


def _refused_by(
    conn: psycopg.Connection, spec: PostgresSink, exc: psycopg.Error, staged: list[str]
) -> str:
    """Why the repair was refused, in terms of the constraint and keys, never row values:
    the keys of rows to insert that collide with rows the table keeps (a unique constraint)
    or that lack a value (a NOT NULL column)."""
    diag = exc.diag
    constraint, column = diag.constraint_name, diag.column_name
    parts = []
    if constraint:
        parts.append(f"constraint {constraint}")
    elif column:
        parts.append(f"column {column}")
    keys: list[str] = []
    if spec.key and len(staged) >= 2:
        try:  # the last (delete, insert) pair staged is the one the repair applied
            keys = _offending_keys(conn, spec, exc, staged[-2:])
        except psycopg.Error:  # the reason stays the constraint's name
            conn.rollback()
    if keys:
        parts.append(f"the rows to insert for {'; '.join(keys)}")
        if isinstance(exc, psycopg.errors.UniqueViolation):
            parts[-1] += " collide with rows the table keeps"
    return f": {', '.join(parts)}" if parts else ""


def _offending_keys(
    conn: psycopg.Connection, spec: PostgresSink, exc: psycopg.Error, staged: list[str]
) -> list[str]:
    """Inside the failed repair's transaction (rolled back to its savepoint): the keys of the
    staged rows to insert that break the constraint `exc` names (at most five)."""
    conn.execute("ROLLBACK TO SAVEPOINT onceflow_repair")
    target = sql.Identifier(spec.schema, spec.table)
    ins = sql.Identifier("onceflow", staged[1])
    keys = sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(c)) for c in spec.key)
    if isinstance(exc, psycopg.errors.NotNullViolation) and exc.diag.column_name:
        query = sql.SQL("SELECT {} FROM {} AS s WHERE s.{} IS NULL LIMIT 5").format(
            keys, ins, sql.Identifier(exc.diag.column_name)
        )
    elif isinstance(exc, psycopg.errors.UniqueViolation) and exc.diag.constraint_name:
        row = conn.execute(
            "SELECT array_agg(a.attname ORDER BY k.n) FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid"
            " CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
            " WHERE i.indrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))"
            " AND c.relname = %s",
            (spec.schema, spec.table, exc.diag.constraint_name),
        ).fetchone()
        columns = [str(c) for c in (row[0] if row and row[0] else [])]
        if not columns:
            return []
        same = sql.SQL(" AND ").join(
            sql.SQL("t.{} = s.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in columns
        )
        # Against the table as the repair's DELETE leaves it (done again here).
        deleted = sql.SQL(" AND ").join(
            sql.SQL("d.{} = t.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in spec.key
        )
        query = sql.SQL(
            "SELECT {} FROM {} AS s WHERE EXISTS (SELECT 1 FROM {} AS t WHERE {}"
            " AND NOT EXISTS (SELECT 1 FROM {} AS d WHERE {})) LIMIT 5"
        ).format(keys, ins, target, same, sql.Identifier("onceflow", staged[0]), deleted)
    else:
        return []
    rows = conn.execute(query).fetchall()
    return [", ".join(f"{c}={v}" for c, v in zip(spec.key, r, strict=True)) for r in rows]


def _staging_names(job: str, spec: PostgresSink, epoch: int | None, attempt: int) -> list[str]:
    digest = hashlib.sha1(f"{job}/{spec.name}/{epoch}".encode()).hexdigest()[:16]
    return [f"reconcile_{digest}_del{attempt}", f"reconcile_{digest}_ins{attempt}"]


def _drop(dsn: str, names: list[str]) -> None:
    if not names:
        return
    try:
        with connect(dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(
                    sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier("onceflow", name))
                )
    except Exception:  # staging litter is harmless; a later reconcile drops it
        pass
