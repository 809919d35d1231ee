"""The dedupe key index: every key a completed window kept, with that window, in PostgreSQL.

First-occurrence dedupe asks, for each key of a new window, whether an earlier window kept it.
Reading the dedupe state sink for that costs the whole history per window; the index answers
with primary-key lookups instead, so a window's cost does not grow with history.

- `onceflow.dedupe_keys (job, key, window_id)`: primary key `(job, key)`; `key` is the dedupe
  key as text (`_keylookup.key_strings`), `window_id` the first window that kept it.
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

A record whose dedupe key has a null part has no key (`_keylookup.null_key_columns`): it is invalid,
quarantined with the reason `dedupe key column <c> is null`, never looked up, kept or indexed.
Run, replay, restatement and reconcile all compute through `_compute.compute`, which applies
that rule, so they agree on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from onceflow._keylookup import KEY_COL, SeenLookup
from onceflow._pgcopy import CopyWriter, check_epoch_in, lock_and_count
from onceflow.postgres import (
    connect,
    is_lost_connection,
    retry_deadline_s,
)

if TYPE_CHECKING:
    from onceflow.ledger import Ledger


_log = logging.getLogger(__name__)


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


# A run's first look, by counts rather than spans (an index-only count of 100,000 windows
# takes a few milliseconds, their spans a quarter of a second): with `c` the newest indexed
# window, every window 1..c is planned (their count is c), those not completed are skipped
# ones (read by the partial index of open windows) and no other, and the index holds exactly
# the rest (its count below c, and none of the skipped). Then 1..c is settled.
_PREFIX_QUERY = """
WITH c AS (SELECT least(coalesce(max(window_id), 0), %(before)s - 1) AS c
           FROM onceflow.dedupe_windows WHERE job = %(job)s)
SELECT c.c,
    (SELECT count(*) FROM onceflow.windows WHERE job = %(job)s AND window_id <= c.c),
    (SELECT count(*) FROM onceflow.dedupe_windows WHERE job = %(job)s AND window_id <= c.c),
    (SELECT coalesce(array_agg(window_id ORDER BY window_id), '{}') FROM onceflow.windows
     WHERE job = %(job)s AND window_id <= c.c AND skipped_at IS NOT NULL
       AND completed_at IS NULL),
    (SELECT count(*) FROM onceflow.windows WHERE job = %(job)s AND window_id <= c.c
       AND (completed_at IS NULL OR skip_reason IS NOT NULL)),
    (SELECT count(*) FROM onceflow.dedupe_windows d JOIN onceflow.windows w USING (job, window_id)
     WHERE d.job = %(job)s AND d.window_id <= c.c
       AND (w.completed_at IS NULL OR w.skip_reason IS NOT NULL))
FROM c
"""


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
        if settled == 1 and before > 1:
            settled, below = self._settled_prefix(before)
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

    def _settled_prefix(self, before: int) -> tuple[int, Spans]:
        """(S, spans of the windows below S the ledger plans and did not skip), from counts
        (`_PREFIX_QUERY`); (1, ()) when they do not prove a prefix settled (`state` then reads
        the spans from the start)."""
        row = self.ledger.read(
            "count the windows the dedupe index holds",
            lambda conn: conn.execute(
                _PREFIX_QUERY, {"job": self.job, "before": before}
            ).fetchone(),
        )
        if row is None:
            return 1, ()
        c, planned, indexed, skipped, open_, open_indexed = row
        c, skipped = int(c), [int(w) for w in skipped]
        settled = (
            c > 0
            and int(planned) == c
            and int(open_) == len(skipped)  # every window not completed is a skipped one
            and int(indexed) == c - len(skipped)
            and int(open_indexed) == 0
        )
        if not settled:
            return 1, ()
        due = _merge(
            (lo, hi)
            for lo, hi in zip(
                [1, *(w + 1 for w in skipped)], [*(w - 1 for w in skipped), c], strict=True
            )
            if lo <= hi
        )
        with self._lock:
            if c + 1 > self._settled[0]:
                self._settled = (c + 1, due)
        return c + 1, due

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
