"""Dedupe key lookups on the executors: each window's keys as text (`key_strings`), records
with a null key part (`null_key_columns`), and whether an earlier window kept a key, asked of
the key index (`onceflow._keyindex`) in chunks by primary key while the next batch is read
(`SeenLookup`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg import sql

from onceflow._identifiers import spark_sql_name, spark_sql_string
from onceflow.errors import SourceError
from onceflow.postgres import (
    is_lost_connection,
    process_sessions,
    retry_delays,
)
from onceflow.sources.base import POSITION_COLUMNS, RAW_TEXT_COLUMN, REASON_COLUMN

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType


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
