"""The ledger's record of what operators asked for: restatements (each window's change written
ahead, numbered, applied once) and windows abandoned for a sink."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import psycopg

    from onceflow.sinks.contract import SinkOutcome

T = TypeVar("T")


@dataclass(frozen=True)
class Restatement:
    """One window of a restatement request, as the ledger records it."""

    seq: int
    window_id: int
    request_id: str  # `<request>/w<window>`
    completed: bool
    # The operator's reason, when it was cancelled (`onceflow restate JOB --cancel REQUEST`).
    cancelled: str | None = None


class _LedgerBase:
    """What these methods use of `onceflow.ledger.Ledger`."""

    job: str

    if TYPE_CHECKING:

        def read(self, what: str, query: Callable[[psycopg.Connection], T]) -> T: ...

        def write(
            self, what: str, work: Callable[[psycopg.Connection], T], epoch: int | None = None
        ) -> T: ...

        def fence(self, conn: psycopg.Connection, epoch: int) -> None: ...

        def record_commits(
            self,
            conn: psycopg.Connection,
            window_id: int,
            commits: Sequence[SinkOutcome],
            restate_seq: int | None = None,
        ) -> None: ...


class Restatements(_LedgerBase):
    """The restatement methods of `onceflow.ledger.Ledger`."""

    def plan_restatement(self, epoch: int, window_id: int, request_id: str, floor: int = 0) -> int:
        """Write a restatement ahead; the same request always gets the same sequence number
        (so an attempt after an unanswered COMMIT finds the one that committed). A new one is
        numbered above `floor`, the highest the sinks applied (the ledger's restatements can
        be lost on their own: a number a sink applied already would be skipped there)."""

        def plan(conn: psycopg.Connection) -> int:
            self.fence(conn, epoch)
            row = conn.execute(
                "SELECT seq FROM onceflow.restatements WHERE job = %s AND request_id = %s",
                (self.job, request_id),
            ).fetchone()
            if row is None:
                row = conn.execute(
                    "INSERT INTO onceflow.restatements (job, seq, window_id, request_id, epoch)"
                    " SELECT %s, greatest(coalesce(max(seq), 0), %s) + 1, %s, %s, %s"
                    " FROM onceflow.restatements WHERE job = %s RETURNING seq",
                    (self.job, floor, window_id, request_id, epoch, self.job),
                ).fetchone()
            assert row is not None
            return int(row[0])

        return self.write(f"plan restatement {request_id}", plan, epoch)

    def pending_restatements(self) -> list[tuple[int, int, str]]:
        """Restatements planned but not finished: (seq, window id, request id)."""
        rows = self.read(
            "read the pending restatements",
            lambda conn: conn.execute(
                "SELECT seq, window_id, request_id FROM onceflow.restatements"
                " WHERE job = %s AND completed_at IS NULL AND cancelled_at IS NULL ORDER BY seq",
                (self.job,),
            ).fetchall(),
        )
        return [(int(s), int(w), str(r)) for s, w, r in rows]

    def complete_restatement(
        self, seq: int, window_id: int | None = None, commits: Sequence[SinkOutcome] = ()
    ) -> None:
        """Mark restatement `seq` done, recording the sink commits that wrote window
        `window_id`'s restated rows in the same transaction."""

        def work(conn: psycopg.Connection) -> None:
            if window_id is not None:
                self.record_commits(conn, window_id, commits, restate_seq=seq)
            conn.execute(
                "UPDATE onceflow.restatements SET completed_at = coalesce(completed_at, now())"
                " WHERE job = %s AND seq = %s AND cancelled_at IS NULL",
                (self.job, seq),
            )

        self.write(f"mark restatement {seq} completed", work)

    def restatements(self, request: str) -> list[Restatement]:
        """Every restatement of `request`: the windows planned under `<request>/w<N>`, or the one
        whose request id is exactly `request`."""
        rows = self.read(
            f"read restatement request {request}",
            lambda conn: conn.execute(
                "SELECT seq, window_id, request_id, completed_at IS NOT NULL, cancel_reason"
                " FROM onceflow.restatements WHERE job = %s"
                " AND (request_id = %s OR left(request_id, length(%s::text) + 2) = %s::text || '/w')"
                " ORDER BY seq",
                (self.job, request, request, request),
            ).fetchall(),
        )
        return [
            Restatement(int(s), int(w), str(r), bool(c), x)
            for s, w, r, c, x in rows
            if r == request or r[len(request) + 2 :].isdigit()
        ]

    def cancelled_restatements(self) -> list[Restatement]:
        """Restatements an operator cancelled, oldest first."""
        rows = self.read(
            "read the cancelled restatements",
            lambda conn: conn.execute(
                "SELECT seq, window_id, request_id, cancel_reason FROM onceflow.restatements"
                " WHERE job = %s AND cancelled_at IS NOT NULL ORDER BY seq",
                (self.job,),
            ).fetchall(),
        )
        return [Restatement(int(s), int(w), str(r), False, str(x)) for s, w, r, x in rows]

    def cancel_restatement(self, epoch: int, seq: int, reason: str) -> None:
        """Record that the operator gave up unfinished restatement `seq` (fenced; never undone;
        a finished one stays finished)."""

        def cancel(conn: psycopg.Connection) -> None:
            self.fence(conn, epoch)
            conn.execute(
                "UPDATE onceflow.restatements SET cancelled_at = coalesce(cancelled_at, now()),"
                " cancel_reason = coalesce(cancel_reason, %s)"
                " WHERE job = %s AND seq = %s AND completed_at IS NULL",
                (reason, self.job, seq),
            )

        self.write(f"cancel restatement {seq}", cancel, epoch)


class Abandonments(_LedgerBase):
    """Completed windows a sink lacks, given up for that sink by an operator."""

    def abandoned(self) -> dict[str, set[int]]:
        """Sink name → the completed windows an operator abandoned for that sink (`onceflow
        windows abandon`): the sink lacks them for good, a known and named gap."""
        out: dict[str, set[int]] = {}
        for wid, sink, _ in self.abandoned_reasons():
            out.setdefault(sink, set()).add(wid)
        return out

    def abandoned_reasons(self) -> list[tuple[int, str, str]]:
        """(window id, sink, reason) of every abandoned window, by window, then sink."""
        rows = self.read(
            "read the abandoned windows",
            lambda conn: conn.execute(
                "SELECT window_id, sink, reason FROM onceflow.abandoned_windows"
                " WHERE job = %s ORDER BY window_id, sink",
                (self.job,),
            ).fetchall(),
        )
        return [(int(w), str(s), str(r)) for w, s, r in rows]

    def abandon_windows(self, epoch: int, sinks: Mapping[int, Sequence[str]], reason: str) -> None:
        """Record, in one fenced transaction, that the operator gave up completed windows for
        the sinks that lack them (window id → sinks); never undone."""
        pairs = [(wid, sink) for wid, names in sorted(sinks.items()) for sink in names]

        def abandon(conn: psycopg.Connection) -> None:
            self.fence(conn, epoch)
            conn.execute(
                "INSERT INTO onceflow.abandoned_windows (job, window_id, sink, reason, epoch)"
                " SELECT %s, w, s, %s, %s FROM unnest(%s::bigint[], %s::text[]) AS x(w, s)"
                " ON CONFLICT DO NOTHING",
                (self.job, reason, epoch, [w for w, _ in pairs], [s for _, s in pairs]),
            )

        self.write("abandon windows", abandon, epoch)
