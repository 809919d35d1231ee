"""The dedupe key index: every key a completed window kept, with that window, in PostgreSQL.

First-occurrence dedupe asks, for each key of a new window, whether an earlier window kept it.
Reading the dedupe state sink for that costs the whole history per window; the index answers
with primary-key lookups instead, so a window's cost does not grow with history.

- `onceflow.dedupe_keys (job, key, window_id)`: primary key `(job, key)`; `key` is the dedupe
  key as text (`key_strings`), `window_id` the first window that kept it.
- `onceflow.dedupe_windows (job, window_id, keys)`: the windows whose keys are in the index.

A window's keys are staged by the executors during its sink write, into a table of the run's
epoch (`staging_writer`, fenced by it), and enter the index in the transaction that marks the
window completed (`KeyIndex.add`), so the index holds exactly the completed windows: a window
planned again over other input, or skipped, never left keys behind. Lookups are filtered by
`window_id < N`, so a window replayed after later ones were indexed (a lost lake put back) is
deduplicated as the first time. If the index lacks completed windows (made before the index
existed, a lost staging table, a ledger rebuilt from the sinks), they are indexed again from the
dedupe state sink before the next window is computed.

What a window's dedupe saw is its `Basis`: the windows in the index when it looked, and those
whose staged keys it read whole. Its outputs hold only while that is every earlier window the
ledger plans and did not skip (`IndexState.due`).

A record whose dedupe key has a null part has no key (`null_key_columns`): it is invalid,
quarantined with the reason `dedupe key column <c> is null`, never looked up, kept or indexed.
Run, replay, restatement and reconcile all compute through `_compute.compute`, which applies
that rule, so they agree on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from onceflow._identifiers import spark_sql_name, spark_sql_string
from onceflow._pgcopy import CopyWriter, check_epoch_in, lock_and_count
from onceflow.errors import SourceError
from onceflow.postgres import (
    connect,
    is_lost_connection,
    process_sessions,
    retry_deadline_s,
    retry_delays,
)
from onceflow.sources.base import POSITION_COLUMNS, RAW_TEXT_COLUMN, REASON_COLUMN

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from onceflow.ledger import Ledger

_log = logging.getLogger(__name__)

KEY_COL = "__dedupe_key"
SEEN_COL = "__seen"
# Most distinct keys one lookup query asks about.
LOOKUP_CHUNK = 20_000
# The lookup sessions' planner settings (in the startup packet: no round trip). A lookup asks
# for up to LOOKUP_CHUNK keys at once; from about half a million keys in the index to a few
# million, PostgreSQL's estimate prefers reading the whole index table (in parallel, taking
# every core) to probing its primary key, and the lookup grows with history (0.11 s at 1M
# keys, 0.32 s at 3M, against 0.04 s by the index at 10M). Probing is always chosen here.
LOOKUP_SETTINGS = {"enable_seqscan": "off", "max_parallel_workers_per_gather": "0"}

DDL = """
CREATE TABLE IF NOT EXISTS onceflow.dedupe_keys (
    job text NOT NULL,
    key text NOT NULL,
    window_id bigint NOT NULL,
    PRIMARY KEY (job, key)
);
CREATE TABLE IF NOT EXISTS onceflow.dedupe_windows (
    job text NOT NULL,
    window_id bigint NOT NULL,
    keys bigint NOT NULL,
    indexed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, window_id)
);
"""


def key_strings(batch: pa.RecordBatch, columns: Sequence[str]) -> pa.Array:
    """The dedupe key of each row as text: the value itself for a one-column key, else a JSON
    array of the values as text; null where a key column is null (a record without a key:
    `null_key_columns`). A null is never text, so no value ("None", "null", "") meets it."""
    import json

    import pyarrow as pa
    import pyarrow.compute as pc

    if len(columns) == 1:
        return pc.cast(batch.column(columns[0]), pa.string())
    parts = [pc.cast(batch.column(c), pa.string()).to_pylist() for c in columns]
    return pa.array(
        [None if None in row else json.dumps(list(row)) for row in zip(*parts, strict=True)],
        pa.string(),
    )


def null_key_columns(
    key: Sequence[str], columns: Sequence[str], internal: Sequence[str] = ()
) -> dict[str, str]:
    """The rule for dedupe keys with a null part, as Spark SQL for the parsed rows' columns.

    Such a record is invalid: `_reason` becomes `dedupe key column <c> is null` (its first
    null key column) and `_raw_text` the record's columns as JSON (a typed source gives no
    text for a valid record). A record that is invalid already keeps its reason.

    Quarantined rather than kept: without its key a record cannot be told from a repeat of
    it, so keeping it may double it and dropping it may lose it (docs/jobs.md).

    Args:
        key: The dedupe key columns.
        columns: The parsed rows' columns.
        internal: Further columns that are not the record's (window id, lookup marks).

    Returns:
        Column name → expression, for `DataFrame.withColumns`.
    """
    reason, raw = spark_sql_name(REASON_COLUMN), spark_sql_name(RAW_TEXT_COLUMN)
    why = " ".join(
        f"WHEN {spark_sql_name(c)} IS NULL THEN {spark_sql_string(f'dedupe key column {c} is null')}"
        for c in key
    )
    skip = {*POSITION_COLUMNS, REASON_COLUMN, RAW_TEXT_COLUMN, *internal}
    record = ", ".join(spark_sql_name(c) for c in columns if c not in skip)
    null_key = " OR ".join(f"{spark_sql_name(c)} IS NULL" for c in key)
    return {
        REASON_COLUMN: f"coalesce({reason}, CASE {why} END)",
        RAW_TEXT_COLUMN: (
            f"CASE WHEN {reason} IS NULL AND ({null_key}) THEN to_json(struct({record}), map('ignoreNullFields', 'false'))"
            f" ELSE {raw} END"
        ),
    }


def text_array(values: pa.Array) -> str:
    """`values` (strings, no nulls) as one PostgreSQL array literal, for a `%s::text[]`
    parameter: every element quoted, `\\` and `"` escaped.

    Built by Arrow kernels and parsed by the server: psycopg's list dumper visits each element
    in Python, about a millisecond per thousand keys."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not len(values):
        return "{}"
    escaped = pc.replace_substring(pc.replace_substring(values, "\\", "\\\\"), '"', '\\"')
    one = pa.ListArray.from_arrays(pa.array([0, len(escaped)], pa.int32()), escaped)
    return '{"' + pc.binary_join(one, '","')[0].as_py() + '"}'


@dataclass(frozen=True)
class SeenLookup:
    """A mapInArrow function adding KEY_COL (the dedupe key as text) and SEEN_COL (an earlier
    window than `before` kept that key) to parsed rows; invalid rows (`_reason` set) and rows
    whose key has a null part (quarantined by the compute: `null_key_columns`) are never seen
    and have no KEY_COL.

    Each batch's distinct keys are asked of the index (LOOKUP_CHUNK at a time) on one
    connection in a thread of the partition's own, while the next batch is parsed; a batch
    leaves once its answer is in, so one lookup at a time is in flight. After a lost connection
    a lookup (a read) is asked again on a new one until `retry_s` has passed."""

    dsn: str
    job: str
    before: int
    columns: tuple[str, ...]
    retry_s: float
    staged: tuple[str, ...] = ()  # key staging tables of earlier windows not yet indexed
    #: The partition is the whole window in source order: a key's valid repeats after its
    #: first occurrence are marked seen too (as the compute's row_number would drop them),
    #: keys compared as their values are.
    in_order: bool = False

    #: The columns it adds, as DDL.
    ADDED_DDL = f"{KEY_COL} STRING, {SEEN_COL} BOOLEAN"

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        import pyarrow.compute as pc

        asking: deque[tuple[pa.RecordBatch, pa.Array, Future[set[str]]]] = deque()
        repeats = _Repeats(self.columns) if self.in_order else None
        with _Asker(self) as asker:
            for batch in batches:
                keys = key_strings(batch, self.columns)
                if REASON_COLUMN in batch.schema.names:
                    keys = pc.if_else(
                        pc.is_null(batch.column(REASON_COLUMN)), keys, pa.scalar(None, pa.string())
                    )
                asking.append((batch, keys, asker.ask(pc.unique(keys).drop_null())))
                while len(asking) > 1:
                    yield self._marked(*asking.popleft(), repeats)
            while asking:
                yield self._marked(*asking.popleft(), repeats)

    def _marked(
        self,
        batch: pa.RecordBatch,
        keys: pa.Array,
        answer: Future[set[str]],
        repeats: _Repeats | None,
    ) -> pa.RecordBatch:
        import pyarrow as pa
        import pyarrow.compute as pc

        seen = pa.array(list(answer.result()), pa.string())
        flags = pc.fill_null(pc.is_in(keys, value_set=seen), False)
        if repeats is not None:
            flags = repeats.mark(batch, flags, pc.is_valid(keys))
        return pa.RecordBatch.from_arrays(
            [*batch.columns, keys, flags],
            schema=batch.schema.append(pa.field(KEY_COL, pa.string())).append(
                pa.field(SEEN_COL, pa.bool_())
            ),
        )

    def queries(self) -> list[tuple[sql.Composable, tuple[object, ...]]]:
        """The statements that find seen keys; a None parameter stands for the keys' array."""
        queries: list[tuple[sql.Composable, tuple[object, ...]]] = [
            (
                sql.SQL(
                    "SELECT key FROM onceflow.dedupe_keys"
                    " WHERE job = %s AND key = ANY(%s::text[]) AND window_id < %s"
                ),
                (self.job, None, self.before),
            )
        ]
        for table in self.staged:
            # A staging table has no index: join it with the keys (a hash join).
            queries.append(
                (
                    sql.SQL(
                        "SELECT DISTINCT s.{key} FROM {table} AS s"
                        " JOIN unnest(%s::text[]) AS k(key) ON s.{key} = k.key"
                    ).format(key=sql.Identifier(KEY_COL), table=sql.Identifier("onceflow", table)),
                    (None,),
                )
            )
        return queries

    def ddl(self, schema: str) -> str:
        """`schema` (the parsed rows' DDL) with the added columns."""
        return f"{schema}, {self.ADDED_DDL}"

    def struct(self, schema: StructType) -> StructType:
        """`schema` (the parsed rows' schema) with the added columns."""
        from pyspark.sql.types import BooleanType, StringType, StructField, StructType

        return StructType(
            [
                *schema.fields,
                StructField(KEY_COL, StringType()),
                StructField(SEEN_COL, BooleanType()),
            ]
        )


class _Repeats:
    """The keys of the valid rows a partition kept so far, to mark later occurrences seen.

    Keys are compared as the compute's `row_number() OVER (PARTITION BY key …)` compares them:
    by value (one key column: the value as text; several: a JSON array of them as text). Rows
    without a key (a null part) take no part."""

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self.kept: list[pa.Array] = []
        self.last = -1  # the position of the partition's last row so far

    def _check_order(self, batch: pa.RecordBatch) -> None:
        """Rows must come in source order (`_file_idx`, `_source_line`), or a later occurrence
        could pass for the first."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if not batch.num_rows:
            return
        position = pc.add(
            pc.multiply(pc.cast(batch.column("_file_idx"), pa.int64()), 1 << 32),
            pc.cast(batch.column("_source_line"), pa.int64()),
        )
        steps = pc.pairwise_diff(position)
        if pc.any(pc.less(steps, 0)).as_py() or position[0].as_py() < self.last:
            raise SourceError(
                "the parse yields rows out of source order though its ArrowParse says "
                "keeps_order=True; fix the parse, or leave keeps_order False."
            )
        self.last = position[-1].as_py()

    def _keys(self, batch: pa.RecordBatch) -> pa.Array:
        import json

        import pyarrow as pa
        import pyarrow.compute as pc

        def text(column: str) -> pa.Array:
            values = batch.column(column)
            if pa.types.is_floating(values.type):
                # As Spark partitions: -0.0 is 0.0 (and every NaN prints alike).
                values = pc.if_else(pc.equal(values, 0), pa.scalar(0, values.type), values)
            return pc.cast(values, pa.string())

        if len(self.columns) == 1:
            return text(self.columns[0])
        parts = [text(c).to_pylist() for c in self.columns]
        return pa.array([json.dumps(list(row)) for row in zip(*parts, strict=True)], pa.string())

    def mark(self, batch: pa.RecordBatch, seen: pa.Array, keyed: pa.Array) -> pa.Array:
        """`seen` (no nulls) also set on the `keyed` rows (valid, with a whole key) whose key an
        earlier keyed, unseen row of the partition had; those earlier rows' keys are
        remembered."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._check_order(batch)
        candidate = pc.and_(pc.invert(seen), keyed)
        rows = pc.indices_nonzero(candidate)
        if not len(rows):
            return seen
        keys = self._keys(batch).take(rows)
        earlier = pa.concat_arrays(self.kept) if self.kept else pa.array([], pa.string())
        before = pc.is_in(keys, value_set=earlier)
        # The first row of each key in this batch.
        firsts = (
            pa.table({"key": keys, "row": rows})
            .group_by("key", use_threads=False)
            .aggregate([("row", "min")])
        )
        first = pc.is_in(rows, value_set=firsts.column("row_min"))
        self.kept.append(pc.unique(keys.filter(pc.invert(before))))
        repeat = pc.or_(before, pc.invert(first))
        marks = pc.replace_with_mask(pa.repeat(False, batch.num_rows), candidate, repeat)
        return pc.or_(seen, marks)


class _Asker:
    """The lookups of one partition: one thread that asks in turn, on a session the worker
    keeps from task to task."""

    def __init__(self, lookup: SeenLookup) -> None:
        self.lookup = lookup
        self.queries = lookup.queries()
        self.sessions = process_sessions(lookup.dsn)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="onceflow-lookup")

    def __enter__(self) -> _Asker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def ask(self, keys: pa.Array) -> Future[set[str]]:
        """The keys of `keys` (distinct, no nulls) that were seen, found in the thread."""
        return self.pool.submit(self._seen, keys)

    def _seen(self, keys: pa.Array) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(keys), LOOKUP_CHUNK):
            found |= self._ask(text_array(keys.slice(start, LOOKUP_CHUNK)))
        return found

    def _ask(self, chunk: str) -> set[str]:
        delays = None
        while True:
            try:
                # An error closes the session: the next attempt starts a new one.
                with self.sessions.session(autocommit=True, settings=LOOKUP_SETTINGS) as conn:
                    rows: set[str] = set()
                    for query, params in self.queries:
                        bound = tuple(chunk if p is None else p for p in params)
                        rows.update(r[0] for r in conn.execute(query, bound))
                    return rows
            except Exception as exc:
                if not is_lost_connection(exc):
                    raise
                delays = delays or retry_delays(self.lookup.retry_s)
                delay = delays()
                if delay is None:
                    raise
                time.sleep(delay)


def key_frame(df: DataFrame, columns: Sequence[str], window_col: str) -> DataFrame:
    """KEY_COL and `window_id` (from `window_col`) of `df`'s rows with non-null keys."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        import pyarrow.compute as pc

        for batch in batches:
            keys = key_strings(batch, columns)
            out = pa.RecordBatch.from_arrays(
                [keys, pc.cast(batch.column(window_col), pa.int64())],
                names=[KEY_COL, "window_id"],
            )
            out = out.filter(pc.is_valid(keys))
            if out.num_rows:
                yield out

    schema = StructType([StructField(KEY_COL, StringType()), StructField("window_id", LongType())])
    return df.select(*columns, window_col).mapInArrow(run, schema)


@dataclass(frozen=True)
class StagedKeys:
    """A window's kept keys staged but not in the index yet (its commit is under way): a later
    window's lookups read them besides the index."""

    window_id: int
    table: str
    rows: int  # as the executors reported them


Spans = tuple[tuple[int, int], ...]  # runs of consecutive window ids, (first, last), sorted


def spans(ids: Iterable[int]) -> Spans:
    """`ids` as runs of consecutive ids."""
    return _merge((w, w) for w in ids)


def _merge(runs: Iterable[tuple[int, int]]) -> Spans:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _below(runs: Spans, before: int) -> Spans:
    return tuple((lo, min(hi, before - 1)) for lo, hi in runs if lo < before)


@dataclass(frozen=True)
class Basis:
    """The earlier windows a window's dedupe saw: those in the key index when it looked, and
    those whose staged keys it read whole."""

    spans: Spans = ()

    def __or__(self, ids: Iterable[int]) -> Basis:
        return Basis(_merge([*self.spans, *((w, w) for w in ids)]))

    def to_json(self) -> list[list[int]]:
        return [[lo, hi] for lo, hi in self.spans]

    @classmethod
    def from_json(cls, value: Sequence[Sequence[int]]) -> Basis:
        return cls(_merge((int(lo), int(hi)) for lo, hi in value))

    def __str__(self) -> str:
        text = ", ".join(f"{lo}-{hi}" if lo != hi else f"{lo}" for lo, hi in self.spans)
        return f"windows {text}" if text else "no window"


@dataclass(frozen=True)
class IndexState:
    """The windows before one window, as the key index and the ledger hold them.

    Below `settled` every window the ledger plans and did not skip (`below`) is completed and
    in the index; from `settled` on, the three sets are given as they are."""

    settled: int
    below: Spans
    indexed_since: frozenset[int] = frozenset()  # whose keys are in the index
    completed_since: frozenset[int] = frozenset()  # the ledger marks completed
    due_since: frozenset[int] = frozenset()  # the ledger plans and did not skip

    @property
    def indexed(self) -> Basis:
        return Basis(self.below) | self.indexed_since

    @property
    def due(self) -> Basis:
        """What a dedupe of the window must see: every earlier window planned, not skipped."""
        return Basis(self.below) | self.due_since

    @property
    def missing(self) -> list[int]:
        """Completed windows whose keys are not in the index."""
        return sorted(self.completed_since - self.indexed_since)

    @property
    def stale(self) -> list[int]:
        """Windows in the index that the ledger does not mark completed (a ledger lost or
        changed): their keys would mark records of other windows seen."""
        return sorted(self.indexed_since - self.completed_since)

    def indexing(self, added: Iterable[int], removed: Iterable[int] = ()) -> IndexState:
        """The state once `added` were put into the index and `removed` taken out."""
        indexed = (self.indexed_since | frozenset(added)) - frozenset(removed)
        return dataclasses.replace(self, indexed_since=indexed)


def _spans_query(tag: str, table: str, where: str) -> sql.Composable:
    # Gaps and islands: consecutive ids share `id - row_number()`; a few rows, not one per
    # window.
    return sql.SQL(
        "SELECT {tag}, min(window_id), max(window_id) FROM (SELECT window_id,"
        " window_id - row_number() OVER (ORDER BY window_id) AS island FROM {table}"
        " WHERE job = %(job)s AND window_id >= %(since)s AND window_id < %(before)s {where})"
        " AS w GROUP BY island"
    ).format(tag=sql.Literal(tag), table=sql.Identifier("onceflow", table), where=sql.SQL(where))


_STATE_QUERY = sql.SQL(" UNION ALL ").join(
    [
        _spans_query("indexed", "dedupe_windows", ""),
        _spans_query("completed", "windows", "AND completed_at IS NOT NULL"),
        _spans_query("due", "windows", "AND skipped_at IS NULL"),
    ]
)


class KeyIndex:
    """The dedupe key index of one job."""

    def __init__(self, dsn: str, job: str, ledger: Ledger) -> None:
        self._dsn = dsn
        self.job = job
        self.ledger = ledger
        self._lock = threading.Lock()
        # (S, the windows below S the ledger plans and did not skip): below S every window is
        # completed and indexed, skipped, or was never planned (`state`).
        self._settled: tuple[int, Spans] = (1, ())

    def ensure_schema(self, conn: psycopg.Connection) -> None:
        # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog; serialise.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
        conn.execute(DDL)

    def lookup(self, key: Sequence[str], before: int, staged: Sequence[str] = ()) -> SeenLookup:
        """The lookup that marks rows whose key a window before `before` kept; `staged` names
        key staging tables of earlier windows whose keys are not in the index yet."""
        return SeenLookup(
            self._dsn, self.job, before, tuple(key), retry_deadline_s(), tuple(staged)
        )

    def reset(self) -> None:
        """Forget what `state` learnt (a new run: the ledger may have changed in between)."""
        with self._lock:
            self._settled = (1, ())

    def state(self, before: int) -> IndexState:
        """The windows before `before` in the index and in the ledger (one round trip, one
        snapshot: a window's keys and its completion are written in one transaction).

        A window that is completed and indexed (or skipped, or was never planned) stays so
        for the run: those found so far are remembered (`reset` forgets them), and only the
        windows after them are read, so a window's look does not grow with history."""
        with self._lock:
            settled, below = self._settled
        if before <= settled:
            return IndexState(before, _below(below, before))
        rows = self.ledger.read(
            "read the windows the dedupe index holds",
            lambda conn: conn.execute(
                _STATE_QUERY, {"job": self.job, "since": settled, "before": before}
            ).fetchall(),
        )
        found: dict[str, set[int]] = {"indexed": set(), "completed": set(), "due": set()}
        for tag, lo, hi in rows:
            found[str(tag)].update(range(int(lo), int(hi) + 1))
        indexed, completed, due = found["indexed"], found["completed"], found["due"]
        now = settled
        while now < before and (now in indexed) == (now in completed) == (now in due):
            now += 1
        below = _merge([*below, *((w, w) for w in due if w < now)])
        with self._lock:
            if now > self._settled[0]:
                self._settled = (now, below)
        return IndexState(
            now,
            below,
            frozenset(w for w in indexed if w >= now),
            frozenset(w for w in completed if w >= now),
            frozenset(w for w in due if w >= now),
        )

    def forget(self, windows: Sequence[int]) -> None:
        """Take `windows`' keys out of the index (windows the ledger does not mark completed)."""

        def work(conn: psycopg.Connection) -> None:
            conn.execute(
                "DELETE FROM onceflow.dedupe_keys WHERE job = %s AND window_id = ANY(%s)",
                (self.job, list(windows)),
            )
            conn.execute(
                "DELETE FROM onceflow.dedupe_windows WHERE job = %s AND window_id = ANY(%s)",
                (self.job, list(windows)),
            )

        self.ledger.write("take windows the ledger lacks out of the dedupe index", work)

    def confirm(self, seen: Basis, staged: Sequence[StagedKeys]) -> Basis:
        """`seen` (the windows in the index when a window's lookups began) and those of
        `staged` still whole now that they are done: a table's rows only ever go (a server
        crash-restart empties UNLOGGED tables), so a whole table was whole for every lookup."""
        whole = [s.window_id for s in staged if self._holds(s)]
        return seen | whole

    def _holds(self, staged: StagedKeys) -> bool:
        def count(conn: psycopg.Connection) -> int | None:
            try:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(
                        sql.Identifier("onceflow", staged.table)
                    )
                ).fetchone()
            except psycopg.errors.UndefinedTable:
                return None
            return int(row[0]) if row else None

        held = self.ledger.read(f"count window {staged.window_id}'s staged keys", count)
        if held != staged.rows:
            _log.warning(
                "window %d's staged dedupe keys were lost (%s of %d rows) while a later window "
                "looked them up",
                staged.window_id,
                held,
                staged.rows,
            )
            return False
        return True

    def staging_writer(
        self,
        output: str,
        window_id: int,
        app: str,
        epoch: int | None = None,
        tag: str = "",
        *,
        fenced: bool = True,
    ) -> CopyWriter:
        """Create the window's key staging table; return the writer that fills it.

        The table is the run's own (its name carries `epoch`): a paused older run can neither
        empty nor refill the table a newer run reads. `fenced` (with `epoch`): its creation and
        every COPY into it commit only while that epoch is the job's current one."""
        digest = hashlib.sha1(f"{self.job}/{window_id}/{tag}".encode()).hexdigest()[:20]
        table = f"keys_{digest}_e{epoch}" if epoch is not None else f"keys_{digest}"
        ident = sql.Identifier("onceflow", table)
        fence = (self.job, epoch) if fenced and epoch is not None else None

        def create(conn: psycopg.Connection) -> None:
            if fence is not None:
                check_epoch_in(conn, *fence)
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
            conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} ({} text, window_id bigint)").format(
                    ident, sql.Identifier(KEY_COL)
                )
            )

        self.ledger.write(f"create window {window_id}'s key staging table", create, epoch)
        return CopyWriter(
            f"{table}__keys", output, self._dsn, app, table, [KEY_COL, "window_id"], fence=fence
        )

    def add(
        self, conn: psycopg.Connection, staging: str, windows: Sequence[int], rows: int
    ) -> bool:
        """Inside `conn`'s transaction, move staged keys into the index and record `windows` as
        indexed; False (nothing moved) if the staging table does not hold exactly `rows` rows
        (a server restart emptied it, a stale copy added to it) or a copy into it stayed under
        way. The table is locked against writers first, so the rows moved are the rows
        counted."""
        ident = sql.Identifier("onceflow", staging)
        conn.execute("SAVEPOINT onceflow_staged_keys")
        try:
            held = lock_and_count(conn, ident)
        except psycopg.errors.LockNotAvailable:
            conn.execute("ROLLBACK TO SAVEPOINT onceflow_staged_keys")
            return False
        if held != rows:
            return False
        if len(windows) != 1 or not self._insert_new(conn, ident):
            # The first window that kept a key wins, whatever order windows are indexed in.
            conn.execute(
                sql.SQL(
                    "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
                    " SELECT %s, {}, min(window_id) FROM {} GROUP BY 2"
                    " ON CONFLICT (job, key) DO UPDATE SET window_id = least("
                    " onceflow.dedupe_keys.window_id, EXCLUDED.window_id)"
                ).format(sql.Identifier(KEY_COL), ident),
                (self.job,),
            )
        conn.execute(
            sql.SQL(
                "INSERT INTO onceflow.dedupe_windows (job, window_id, keys)"
                " SELECT %s, w, (SELECT count(*) FROM {} WHERE window_id = w)"
                " FROM unnest(%s::bigint[]) AS w ON CONFLICT (job, window_id) DO NOTHING"
            ).format(ident),
            (self.job, list(windows)),
        )
        return True

    def _insert_new(self, conn: psycopg.Connection, staging: sql.Identifier) -> bool:
        """Insert one window's staged keys as new ones; False (nothing inserted) if one is in
        the index already.

        A window's kept keys are distinct and, the first time it is indexed, new: a plain insert
        costs a third less than the merge (measured). It fails only when the window is indexed
        again, and then the merge does it."""
        conn.execute("SAVEPOINT onceflow_new_keys")
        try:
            conn.execute(
                sql.SQL(
                    "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
                    " SELECT %s, {}, window_id FROM {} ORDER BY 2"
                ).format(sql.Identifier(KEY_COL), staging),
                (self.job,),
            )
        except psycopg.errors.UniqueViolation:
            conn.execute("ROLLBACK TO SAVEPOINT onceflow_new_keys")
            return False
        conn.execute("RELEASE SAVEPOINT onceflow_new_keys")
        return True

    def drop_staging(self, staging: str) -> None:
        try:
            with connect(self._dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier("onceflow", staging))
                )
        except psycopg.Error as exc:  # litter is harmless; the next window's drop replaces it
            if not is_lost_connection(exc):
                raise
