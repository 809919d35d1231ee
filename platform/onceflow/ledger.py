"""The ledger: a job's epochs and its write-ahead plan of windows, kept in PostgreSQL.

The sinks are the truth about what was committed; the ledger holds the plan (which input each
window covers) so that a replay reads exactly the same input, and it can be rebuilt from the
offsets every sink commit records.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql

from onceflow import _plans_folded as plans_folded
from onceflow import faults
from onceflow._identifiers import session_name
from onceflow._ledger_requests import Abandonments, Restatement, Restatements
from onceflow._ledger_schema import DDL as _DDL
from onceflow._ledger_schema import DETAIL_DDL, VERIFIED_DDL
from onceflow._plans_folded import FOLDED_DDL as PLANS_FOLDED_DDL
from onceflow.errors import FencedError, LedgerError
from onceflow.lineage import ensure_view
from onceflow.postgres import Sessions, connect, retrying
from onceflow.sink_state import DDL as SINK_STATE_DDL

if TYPE_CHECKING:
    from onceflow.sinks.contract import SinkOutcome

_log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA = "onceflow"
# A newer run waits at most this long for an older run's locks before it ends that run's sessions.
LOCK_WAIT_S = 5
# The server ends a session left idle inside a transaction (a frozen run) after this long.
IDLE_IN_TRANSACTION_TIMEOUT = "60s"
_WRITE_SETTINGS = {"idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_TIMEOUT}


@dataclass(frozen=True)
class Window:
    """One window of a job: an immutable slice of the source, identified by a dense id."""

    job: str
    window_id: int
    offsets: dict[str, Any]
    epoch: int
    stats: dict[str, Any] | None = field(default=None, compare=False)
    completed: bool = field(default=False, compare=False)
    # The operator's reason, when the window was skipped (`onceflow windows skip`).
    skipped: str | None = field(default=None, compare=False)


class Ledger(Restatements, Abandonments):
    """Epochs and the window plan of one job."""

    def __init__(self, dsn: str, job: str) -> None:
        self._dsn = dsn
        self.job = job
        # Kept for reuse while a run processes its windows (`Engine`): the ledger's reads and
        # writes, and the sinks' reads, are a dozen short sessions a window.
        self.sessions = Sessions(dsn)

    def connect(self, epoch: int | None = None) -> psycopg.Connection:
        """A connection for a write transaction, named after the run's epoch; the server ends
        it if it is left idle inside a transaction (set at connect time: no round trip)."""
        return connect(
            self._dsn,
            application_name=session_name(self.job, epoch),
            settings=_WRITE_SETTINGS,
        )

    def _session(self, epoch: int | None) -> AbstractContextManager[psycopg.Connection]:
        """`connect(epoch)`, reused inside `sessions.kept()`."""
        return self.sessions.session(
            application_name=session_name(self.job, epoch), settings=_WRITE_SETTINGS
        )

    # Every ledger round trip survives a lost connection (`onceflow.postgres.retrying`): reads
    # and idempotent writes are simply done again; a write that is not idempotent first looks
    # whether its unanswered COMMIT was applied (`_decided`). New methods should use these.

    def read(self, what: str, query: Callable[[psycopg.Connection], T]) -> T:
        """Run `query(conn)` on an autocommit connection (no transaction, no COMMIT to lose),
        again after a lost connection."""

        def attempt() -> T:
            with self.sessions.session(
                autocommit=True, application_name=session_name(self.job, None)
            ) as conn:
                return query(conn)

        return retrying(attempt, what=f"{what} (job {self.job})", dsn=self._dsn)

    def write(
        self, what: str, work: Callable[[psycopg.Connection], T], epoch: int | None = None
    ) -> T:
        """Run `work(conn)` in one transaction and commit it, all again after a lost connection:
        for idempotent writes only (IF NOT EXISTS, ON CONFLICT DO NOTHING, set-to-a-value)."""

        def attempt() -> T:
            with self._session(epoch) as conn:
                result = work(conn)
                conn.commit()
                return result

        return retrying(attempt, what=f"{what} (job {self.job})", dsn=self._dsn)

    def _decided(
        self,
        what: str,
        work: Callable[[psycopg.Connection], tuple[T, Any]],
        written: Callable[[psycopg.Connection, Any], T | None],
        epoch: int | None = None,
    ) -> T:
        """A write that must not be applied twice. `work(conn)` does it inside the transaction
        and returns (result, evidence); if the COMMIT then gets no answer, the next attempt first
        waits until that transaction has ended (ending its session if the server still runs it)
        and asks `written(conn, evidence)`, which returns the result when the write is there (it
        committed) or None (it did not: do it again)."""
        unanswered: list[tuple[Any, str, int]] = []

        def decide(conn: psycopg.Connection) -> T | None:
            evidence, xid, pid = unanswered[-1]
            row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
            if row is not None and row[0] == "in progress":
                # Its COMMIT may still arrive: end the session (a COMMIT under way completes
                # first), then ask again.
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                raise psycopg.OperationalError("the unanswered COMMIT was still in progress")
            return written(conn, evidence)

        def attempt() -> T:
            if unanswered:
                found = self.read(f"learn whether {what} committed", decide)
                unanswered.clear()
                if found is not None:
                    _log.info("job %s: the unanswered COMMIT to %s had committed", self.job, what)
                    return found
            with self._session(epoch) as conn:
                result, evidence = work(conn)
                row = conn.execute("SELECT pg_current_xact_id()::text, pg_backend_pid()").fetchone()
                assert row is not None
                unanswered.append((evidence, str(row[0]), int(row[1])))
                conn.commit()  # from here on it may apply unanswered
                unanswered.clear()
                return result

        return retrying(attempt, what=f"{what} (job {self.job})", dsn=self._dsn)

    def ensure_schema(self) -> None:
        """Create the ledger tables if they are missing (idempotent, safe to race)."""

        def create(conn: psycopg.Connection) -> None:
            # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog; serialise.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('onceflow.schema'))")
            conn.execute(_DDL)
            conn.execute(DETAIL_DDL)
            conn.execute(VERIFIED_DDL)
            conn.execute(PLANS_FOLDED_DDL)
            conn.execute(SINK_STATE_DDL)
            ensure_view(conn)

        self.write("create the ledger tables", create)

    # -- epochs -------------------------------------------------------------------------------

    def acquire_epoch(self, run_id: str, floor: int = 0) -> int:
        """Take a new epoch, higher than any before and than `floor`, fencing older runs.

        An older run that is frozen while holding the job's row lock would block this forever;
        after LOCK_WAIT_S its sessions are ended so the newer run can go on.
        """
        deadline = time.monotonic() + 6 * LOCK_WAIT_S

        def take(conn: psycopg.Connection) -> tuple[int, int]:
            conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{LOCK_WAIT_S}s")))
            row = conn.execute(
                """
                INSERT INTO onceflow.jobs AS j (job, epoch, run_id)
                VALUES (%(job)s, %(floor)s + 1, %(run_id)s)
                ON CONFLICT (job) DO UPDATE
                   SET epoch = greatest(j.epoch, %(floor)s) + 1, run_id = %(run_id)s,
                       epoch_started_at = now(), heartbeat_at = now()
                RETURNING epoch
                """,
                {"job": self.job, "floor": floor, "run_id": run_id},
            ).fetchone()
            assert row is not None
            return int(row[0]), int(row[0])

        def taken(conn: psycopg.Connection, epoch: int) -> int | None:
            # The job row names the run that holds the epoch: ours if the COMMIT applied (a
            # newer run since would hold a higher epoch: then take one above it, as any run does).
            row = conn.execute(
                "SELECT 1 FROM onceflow.jobs WHERE job = %s AND epoch = %s AND run_id = %s",
                (self.job, epoch, run_id),
            ).fetchone()
            return epoch if row is not None else None

        while True:
            try:
                return self._decided("take a new epoch", take, taken)
            except psycopg.errors.LockNotAvailable:
                if time.monotonic() > deadline:
                    raise LedgerError(
                        f"job {self.job!r}: could not take a new epoch: another session keeps "
                        "the job's row locked and could not be ended. Check "
                        "pg_stat_activity for sessions named onceflow/" + self.job
                    ) from None
                ended = self.write("end an older run's sessions", self._end_older_sessions)
                _log.warning("job %s: ended %d session(s) of an older run", self.job, ended)

    def _end_older_sessions(self, conn: psycopg.Connection) -> int:
        # Also a session without an epoch left idle in a transaction: the remains of a start-up
        # whose connection was lost before its COMMIT (the server has not noticed yet). Every
        # write such a session can hold is retried or decided by its writer, so ending it is safe.
        rows = conn.execute(
            """
            SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE pid <> pg_backend_pid()
               AND ((application_name LIKE %s AND application_name <> %s)
                    OR (application_name = %s AND state LIKE 'idle in transaction%%'
                        AND state_change < now() - make_interval(secs => %s)))
            """,
            (
                f"onceflow/{self.job}/e%",
                session_name(self.job, None),
                session_name(self.job, None),
                LOCK_WAIT_S,
            ),
        ).fetchall()
        conn.commit()
        return sum(1 for (ok,) in rows if ok)

    def current_epoch(self) -> int | None:
        row = self.read(
            "read the current epoch",
            lambda conn: conn.execute(
                "SELECT epoch FROM onceflow.jobs WHERE job = %s", (self.job,)
            ).fetchone(),
        )
        return None if row is None else int(row[0])

    def fence(self, conn: psycopg.Connection, epoch: int) -> None:
        """Inside `conn`'s open transaction, lock the job row if `epoch` is still current.

        Raises FencedError when a newer run has taken over. The lock is held until the
        transaction ends, so a newer run cannot take over halfway through a commit.
        """
        cur = conn.execute(
            "UPDATE onceflow.jobs SET heartbeat_at = now() WHERE job = %s AND epoch = %s",
            (self.job, epoch),
        )
        if cur.rowcount != 1:
            raise FencedError(
                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a newer run; it "
                "stopped without writing. The newer run owns the job now."
            )

    def check_epoch(self, epoch: int) -> None:
        """Raise FencedError if a newer run has taken over."""
        current = self.current_epoch()
        if current != epoch:
            raise FencedError(
                f"job {self.job!r}: this run (epoch {epoch}) was fenced by a newer run (epoch "
                f"{current}); it stopped without writing. The newer run owns the job now."
            )

    # -- windows ------------------------------------------------------------------------------

    def ping(self, what: str) -> None:
        """Reach the server (after its retries), so a server that is gone is named as such."""
        self.read(what, lambda conn: conn.execute(";"))

    def oldest_planned_at(self) -> datetime | None:
        """When the job's oldest window still in the plan was planned (None: no window)."""
        row = self.read(
            "read the oldest window's age",
            lambda conn: conn.execute(
                "SELECT min(planned_at) FROM onceflow.windows WHERE job = %s", (self.job,)
            ).fetchone(),
        )
        return row[0] if row else None

    def windows(self, *, pending_only: bool = False, since: int = 0) -> list[Window]:
        """The job's windows in order; `pending_only`: those not completed nor skipped."""
        where = "window_id > %s" + (
            " AND completed_at IS NULL AND skipped_at IS NULL" if pending_only else ""
        )
        return self.windows_where(sql.SQL(where), (since,), "read the windows")

    def window(self, window_id: int) -> Window | None:
        found = self.windows_where(
            sql.SQL("window_id = %s"), (window_id,), f"read window {window_id}"
        )
        return found[0] if found else None

    def windows_where(
        self, where: sql.Composable, params: Sequence[Any], what: str
    ) -> list[Window]:
        """The job's windows matching `where` (a condition of the caller's, never input), in
        order, with their plans (a folded plan read back from its folded row)."""
        rows = self.read(what, lambda conn: plans_folded.window_rows(conn, self.job, where, params))
        return [Window(self.job, int(w), o, int(e), s, bool(c), r) for w, o, s, e, c, r in rows]

    def last_window_id(self) -> int:
        row = self.read(
            "read the last window id",
            lambda conn: conn.execute(
                "SELECT coalesce(max(window_id), 0) FROM onceflow.windows WHERE job = %s",
                (self.job,),
            ).fetchone(),
        )
        return int(row[0]) if row else 0

    def unplanned(self, units: Sequence[str]) -> list[str]:
        """The source units (in the given order) that no window has taken yet."""
        if not units:
            return []
        rows = self.read(
            "find the unplanned input",
            lambda conn: conn.execute(
                "SELECT p FROM unnest(%s::text[]) WITH ORDINALITY AS u(p, i)"
                " WHERE NOT EXISTS (SELECT 1 FROM onceflow.source_units f"
                "                   WHERE f.job = %s AND f.unit = u.p) ORDER BY i",
                (list(units), self.job),
            ).fetchall(),
        )
        return [p for (p,) in rows]

    def last_offsets(self) -> dict[str, Any] | None:
        """The offsets of the newest planned window (None before the first)."""
        row = self.read(
            "read the last window's offsets",
            lambda conn: plans_folded.fill(
                conn,
                self.job,
                conn.execute(
                    "SELECT window_id, offsets, stats FROM onceflow.windows WHERE job = %s"
                    " ORDER BY window_id DESC LIMIT 1",
                    (self.job,),
                ).fetchall(),
            ),
        )
        return dict(row[0][1]) if row else None

    def plan_window(self, epoch: int, offsets: dict[str, Any], units: Iterable[str]) -> Window:
        """Write a new window ahead of processing it (fenced; its units are taken for good).

        If the COMMIT gets no answer, the window is looked up by its id, epoch and offsets
        before planning again, so a lost answer never plans the same input twice."""
        units = list(units)

        def plan(conn: psycopg.Connection) -> tuple[Window, int]:
            self.fence(conn, epoch)
            row = conn.execute(
                "SELECT coalesce(max(window_id), 0) + 1 FROM onceflow.windows WHERE job = %s",
                (self.job,),
            ).fetchone()
            assert row is not None
            window_id = int(row[0])
            conn.execute(
                "INSERT INTO onceflow.windows (job, window_id, offsets, epoch)"
                " VALUES (%s, %s, %s, %s)",
                (self.job, window_id, json.dumps(offsets), epoch),
            )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO onceflow.source_units (job, unit, window_id) VALUES (%s, %s, %s)",
                    [(self.job, unit, window_id) for unit in units],
                )
            faults.point("plan", window_id)
            return Window(self.job, window_id, offsets, epoch), window_id

        def planned(conn: psycopg.Connection, window_id: int) -> Window | None:
            row = conn.execute(
                "SELECT 1 FROM onceflow.windows WHERE job = %s AND window_id = %s AND epoch = %s"
                " AND offsets = %s::jsonb",
                (self.job, window_id, epoch, json.dumps(offsets)),
            ).fetchone()
            return None if row is None else Window(self.job, window_id, offsets, epoch)

        return self._decided("plan a window", plan, planned, epoch)

    def restore_window(self, window: Window, units: Iterable[str]) -> None:
        """Put back a window rebuilt from the sinks' commit records (ledger loss)."""
        indexed = [(u, window.window_id) for u in units]

        def restore(conn: psycopg.Connection) -> None:
            conn.execute(
                "INSERT INTO onceflow.windows (job, window_id, offsets, epoch) VALUES"
                " (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (self.job, window.window_id, json.dumps(window.offsets), window.epoch),
            )
            self._index_units(conn, indexed)

        self.write(f"restore window {window.window_id}", restore)

    def restore_units(self, units: Iterable[tuple[str, int]]) -> None:
        """Re-create the unit index (unit, window id) from the windows' offsets. A unit the
        index gives to a window that is not planned (a row moved or a plan row lost) goes back
        to the planned window whose offsets name it: windows a sink holds were put back first."""
        indexed = list(units)
        if indexed:
            self.write(
                "restore the unit index",
                lambda conn: self._index_units(conn, indexed, take_from_unplanned=True),
            )

    def _index_units(
        self,
        conn: psycopg.Connection,
        units: list[tuple[str, int]],
        *,
        take_from_unplanned: bool = False,
    ) -> None:
        if not units:
            return
        conflict = (
            "DO UPDATE SET window_id = excluded.window_id"
            " WHERE NOT EXISTS (SELECT 1 FROM onceflow.windows p"
            "                   WHERE p.job = s.job AND p.window_id = s.window_id)"
            if take_from_unplanned
            else "DO NOTHING"
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO onceflow.source_units AS s (job, unit, window_id)"
                " SELECT %s, u, w FROM unnest(%s::text[], %s::bigint[]) AS x(u, w)"
                " ON CONFLICT (job, unit) {}"
            ).format(sql.SQL(conflict)),  # one of the two constant clauses above
            (self.job, [u for u, _ in units], [w for _, w in units]),
        )

    def indexed_windows(self) -> set[int]:
        """Windows that have at least one unit in the index."""
        rows = self.read(
            "read the unit index",
            lambda conn: conn.execute(
                "SELECT DISTINCT window_id FROM onceflow.source_units WHERE job = %s", (self.job,)
            ).fetchall(),
        )
        return {int(w) for (w,) in rows}

    def record_stats(self, window_id: int, stats: dict[str, Any]) -> None:
        def record(conn: psycopg.Connection) -> None:
            cur = conn.execute(
                "UPDATE onceflow.windows SET stats = %s WHERE job = %s AND window_id = %s"
                " AND offsets IS NOT NULL",
                (json.dumps(stats), self.job, window_id),
            )
            if not cur.rowcount:  # folded past the detail horizon (or not planned)
                plans_folded.record_stats(conn, self.job, window_id, stats)

        self.write(f"record window {window_id}'s stats", record)

    def record_commits(
        self,
        conn: psycopg.Connection,
        window_id: int,
        commits: Sequence[SinkOutcome],
        restate_seq: int | None = None,
    ) -> None:
        """Inside `conn`'s transaction, record each sink commit of the window, or of its
        restatement `restate_seq` (data version, commit id, rows), for lineage (idempotent)."""
        if not commits:
            return
        conn.execute(
            "INSERT INTO onceflow.sink_versions"
            " (job, window_id, sink, version, commit_ref, rows_written, restate_seq)"
            " SELECT %s, %s, s, v, c, r, %s"
            " FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bigint[]) AS x(s, v, c, r)"
            " ON CONFLICT (job, window_id, sink) DO UPDATE SET version = EXCLUDED.version,"
            " commit_ref = EXCLUDED.commit_ref, rows_written = EXCLUDED.rows_written,"
            " restate_seq = EXCLUDED.restate_seq, recorded_at = now()",
            (
                self.job,
                window_id,
                restate_seq,
                [c.sink for c in commits],
                [c.data_version for c in commits],
                [c.commit_ref for c in commits],
                # A commit of an earlier run whose record does not count its rows: unknown.
                [c.rows if c.committed or c.rows else None for c in commits],
            ),
        )

    def mark_completed(
        self,
        window_id: int,
        also: Callable[[psycopg.Connection], T] | None = None,
        commits: Sequence[SinkOutcome] = (),
    ) -> T | None:
        """Mark the window completed (every sink holds it), with `also(conn)` in the same
        transaction, and return what `also` returned; `also` must be idempotent (the whole
        transaction is retried). `commits`: the sink commits that wrote the window, recorded for
        the lineage view."""

        def work(conn: psycopg.Connection) -> T | None:
            done = also(conn) if also is not None else None
            self.mark_completed_in(conn, window_id, commits)
            return done

        return self.write(f"mark window {window_id} completed", work)

    def mark_completed_in(
        self, conn: psycopg.Connection, window_id: int, commits: Sequence[SinkOutcome] = ()
    ) -> None:
        """Inside `conn`'s transaction, what `mark_completed` does (idempotent)."""
        self.record_commits(conn, window_id, commits)
        conn.execute(
            "UPDATE onceflow.windows SET completed_at = now()"
            " WHERE job = %s AND window_id = %s AND completed_at IS NULL",
            (self.job, window_id),
        )

    def skipped_windows(self) -> list[tuple[int, str]]:
        """Windows an operator skipped, with the reasons, in window order."""
        rows = self.read(
            "read the skipped windows",
            lambda conn: conn.execute(
                "SELECT window_id, skip_reason FROM onceflow.windows"
                " WHERE job = %s AND skipped_at IS NOT NULL ORDER BY window_id",
                (self.job,),
            ).fetchall(),
        )
        return [(int(w), str(r)) for w, r in rows]

    def skip_window(self, epoch: int, window_id: int, reason: str) -> None:
        """Record that the operator gave up a pending window (fenced; never undone)."""

        def skip(conn: psycopg.Connection) -> None:
            self.fence(conn, epoch)
            conn.execute(
                "UPDATE onceflow.windows SET skipped_at = coalesce(skipped_at, now()),"
                " skip_reason = coalesce(skip_reason, %s)"
                " WHERE job = %s AND window_id = %s AND completed_at IS NULL",
                (reason, self.job, window_id),
            )

        self.write(f"skip window {window_id}", skip, epoch)

    def rebase_window(self, epoch: int, window_id: int, offsets: Mapping[str, Any]) -> None:
        """Point a window at its input as it is now (`Source.rebased`: the same units, what
        they hold recorded anew); fenced, and set-to-a-value, so a retry is harmless."""

        def rebase(conn: psycopg.Connection) -> None:
            self.fence(conn, epoch)
            conn.execute(
                "UPDATE onceflow.windows SET offsets = %s WHERE job = %s AND window_id = %s",
                (json.dumps(dict(offsets)), self.job, window_id),
            )

        self.write(f"rebase window {window_id}", rebase, epoch)

    def epoch_floor(self) -> int:
        """The highest epoch the job's windows, restatements and abandonments were written
        under: the job row can be lost on its own, and a new epoch must still be above them."""
        row = self.read(
            "read the ledger's highest epoch",
            lambda conn: conn.execute(
                "SELECT greatest("
                " (SELECT max(epoch) FROM onceflow.windows WHERE job = %(job)s),"
                " (SELECT max(epoch) FROM onceflow.restatements WHERE job = %(job)s),"
                " (SELECT max(epoch) FROM onceflow.abandoned_windows WHERE job = %(job)s))",
                {"job": self.job},
            ).fetchone(),
        )
        return int(row[0]) if row and row[0] is not None else 0

    def release_units(self, epoch: int, window_ids: Sequence[int]) -> int:
        """Drop from the unit index the units taken by `window_ids` if no such window is
        planned (fenced): their input is new again. Returns the units released."""

        def release(conn: psycopg.Connection) -> int:
            self.fence(conn, epoch)
            # Decided in the statement itself: a window planned meanwhile keeps its units.
            cur = conn.execute(
                "DELETE FROM onceflow.source_units u WHERE u.job = %s AND u.window_id = ANY(%s)"
                " AND NOT EXISTS (SELECT 1 FROM onceflow.windows w"
                "                 WHERE w.job = u.job AND w.window_id = u.window_id)",
                (self.job, list(window_ids)),
            )
            return cur.rowcount

        return self.write("release input of windows lost from the plan", release, epoch)


__all__ = ["Ledger", "Restatement", "Window"]
