"""What the ledger expects each sink to hold, for a sink to prove it before every commit.

A sink's own records (a Delta table's application transaction, say) say how far it got, not
that it got there in one piece: a table deleted and created again, or restored from an older
copy, starts again from the middle. So the ledger records each sink's identity (a Delta table's
id, taken when onceflow created or adopted the table) and knows which windows the sink must
hold before window N (every completed window before N that was neither skipped nor abandoned
for it) and which restatements. A sink checks these on the snapshot it commits against, in the
same atomic commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")


class LedgerAccess(Protocol):
    """What the sink state uses of `onceflow.ledger.Ledger` (the ledger creates this module's
    table, so the type is stated here rather than imported)."""

    job: str

    def read(self, what: str, query: Callable[[psycopg.Connection], T]) -> T: ...

    def write(
        self, what: str, work: Callable[[psycopg.Connection], T], epoch: int | None = None
    ) -> T: ...


DDL = """
CREATE TABLE IF NOT EXISTS onceflow.sink_tables (
    job text NOT NULL,
    sink text NOT NULL,
    identity text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
"""


@dataclass(frozen=True)
class Expected:
    """What a sink must be before it commits a window.

    Attributes:
        identity: The table's identity the ledger recorded (None: none recorded yet).
        through: The window the sink must hold last before this one (0: none).
        restated: The highest restatement the sink must have applied (0: none).
    """

    identity: str | None
    through: int
    restated: int


class SinkState:
    """The ledger's record of one job's sinks: identities and what each must hold."""

    def __init__(self, ledger: LedgerAccess) -> None:
        self.ledger = ledger
        self.job = ledger.job

    def expected(self, sink: str, before: int) -> Expected:
        """What `sink` must hold before it commits window `before` (one round trip)."""

        def read(conn: psycopg.Connection) -> tuple[str | None, int, int]:
            row = conn.execute(
                "SELECT (SELECT identity FROM onceflow.sink_tables WHERE job = %(job)s"
                "        AND sink = %(sink)s),"
                # Newest first by the primary key, stopping at the first match: a year of
                # windows costs what the last few do.
                " coalesce((SELECT w.window_id FROM onceflow.windows w"
                "  WHERE w.job = %(job)s AND w.window_id < %(before)s"
                "  AND w.completed_at IS NOT NULL AND w.skipped_at IS NULL"
                "  AND NOT EXISTS (SELECT 1 FROM onceflow.abandoned_windows a"
                "   WHERE a.job = w.job AND a.window_id = w.window_id AND a.sink = %(sink)s)"
                "  ORDER BY w.window_id DESC LIMIT 1), 0),"
                " coalesce((SELECT r.seq FROM onceflow.restatements r"
                "  WHERE r.job = %(job)s AND r.completed_at IS NOT NULL"
                "  ORDER BY r.seq DESC LIMIT 1), 0)",
                {"job": self.job, "sink": sink, "before": before},
            ).fetchone()
            assert row is not None
            return row[0], int(row[1]), int(row[2])

        identity, through, restated = self.ledger.read(
            f"read what sink {sink} must hold before window {before}", read
        )
        return Expected(identity, through, restated)

    def identity(self, sink: str) -> str | None:
        row = self.ledger.read(
            f"read sink {sink}'s identity",
            lambda conn: conn.execute(
                "SELECT identity FROM onceflow.sink_tables WHERE job = %s AND sink = %s",
                (self.job, sink),
            ).fetchone(),
        )
        return str(row[0]) if row else None

    def identities(self, sinks: list[str]) -> dict[str, str | None]:
        """Each sink's recorded identity (None where none is recorded), in one round trip."""
        rows = self.ledger.read(
            "read the sinks' identities",
            lambda conn: conn.execute(
                "SELECT sink, identity FROM onceflow.sink_tables WHERE job = %s AND sink = ANY(%s)",
                (self.job, sinks),
            ).fetchall(),
        )
        found = {str(sink): str(identity) for sink, identity in rows}
        return {sink: found.get(sink) for sink in sinks}

    def record_identity(self, sink: str, identity: str) -> None:
        """Record the table `sink` writes to from now on (set-to-a-value: safe to repeat)."""
        self.ledger.write(
            f"record sink {sink}'s identity",
            lambda conn: conn.execute(
                "INSERT INTO onceflow.sink_tables (job, sink, identity) VALUES (%s, %s, %s)"
                " ON CONFLICT (job, sink) DO UPDATE SET identity = EXCLUDED.identity,"
                " recorded_at = now()",
                (self.job, sink, identity),
            ),
        )

    def forget_identity(self, sink: str) -> None:
        """Forget `sink`'s table, so the next window that may create it does (reconcile of a
        lost table); set-to-a-value, safe to repeat."""
        self.ledger.write(
            f"forget sink {sink}'s identity",
            lambda conn: conn.execute(
                "DELETE FROM onceflow.sink_tables WHERE job = %s AND sink = %s",
                (self.job, sink),
            ),
        )

    def restated_through(self) -> int:
        """The highest completed restatement of the job (0: none)."""
        row = self.ledger.read(
            "read the newest completed restatement",
            lambda conn: conn.execute(
                "SELECT coalesce(max(seq), 0) FROM onceflow.restatements"
                " WHERE job = %s AND completed_at IS NOT NULL",
                (self.job,),
            ).fetchone(),
        )
        return int(row[0]) if row else 0
