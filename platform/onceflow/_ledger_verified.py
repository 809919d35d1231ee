"""The ledger's verified point: start-up checks only what changed since the last one.

Start-up checks the plan against the unit index both ways (windows without units, units
without windows) and that window ids run without a gap. Over every window ever, those checks
grow with the job's history. A run that passes them records the point it verified
(`onceflow.ledger_verified`: every window 1..through present, with its units, and no unit
naming a missing window), and the next start-up checks only the windows above it and the
windows whose rows were removed since.

Removed rows are noted by the server itself: triggers on `windows` and `source_units` note
the window id of every row deleted (or moved to another job or window) in
`onceflow.ledger_removals`, and a `TRUNCATE` as a removal of everything. A table dropped and
created again (or restored from a backup) has a new oid, which the verified point names; so
does every other way a whole table can go (the notes' own table included). In each such case the next start-up checks
everything again, as it did before it had a verified point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg import sql

if TYPE_CHECKING:
    from onceflow.ledger import Ledger


# The oids of the two tables checked and of the removal notes (their ids start again in a new
# table): another oid means a table was created again.
_TABLES = sql.SQL(
    "ARRAY[to_regclass('onceflow.windows')::oid, to_regclass('onceflow.source_units')::oid,"
    " to_regclass('onceflow.ledger_removals')::oid]"
)


@dataclass(frozen=True)
class Verified:
    """What the last passed start-up verified, and what was removed since."""

    through: int  # every window 1..through was present with its units, and none is missing
    removed: frozenset[int]  # window ids whose rows (plan or units) were removed since
    removals_through: int  # the newest removal note read


def read(ledger: Ledger) -> Verified | None:
    """The job's verified point, or None when everything must be checked: none recorded, a
    table created again since, or a table emptied (`TRUNCATE`)."""
    query = sql.SQL(
        "SELECT v.through, v.tables = {tables},"
        " coalesce((SELECT max(id) FROM onceflow.ledger_removals), 0),"
        " coalesce((SELECT array_agg(DISTINCT r.window_id) FROM onceflow.ledger_removals r"
        "           WHERE r.id > v.removals_through AND r.job = %(job)s), '{{}}'),"
        " EXISTS (SELECT 1 FROM onceflow.ledger_removals r"
        "         WHERE r.id > v.removals_through AND r.job IS NULL)"
        " FROM onceflow.ledger_verified v WHERE v.job = %(job)s"
    ).format(tables=_TABLES)
    row = ledger.read(
        "read the ledger's verified point",
        lambda conn: conn.execute(query, {"job": ledger.job}).fetchone(),  # type: ignore[arg-type]
    )
    if row is None:
        return None
    through, same_tables, newest, removed, emptied = row
    if not same_tables or emptied:  # NULL when a table is missing: checked whole
        return None
    return Verified(int(through), frozenset(int(w) for w in removed), int(newest))


def newest_removal(ledger: Ledger) -> int:
    """The newest removal note's id (read before a full check: notes after it are new)."""
    row = ledger.read(
        "read the ledger's removal notes",
        lambda conn: conn.execute(
            "SELECT coalesce(max(id), 0) FROM onceflow.ledger_removals"
        ).fetchone(),
    )
    return int(row[0]) if row else 0


def record(ledger: Ledger, epoch: int, through: int, removals_through: int) -> None:
    """Record that the ledger was checked whole through window `through`, with every removal
    note up to `removals_through` looked at."""
    ledger.write(
        "record the ledger's verified point",
        lambda conn: conn.execute(
            sql.SQL(
                "INSERT INTO onceflow.ledger_verified AS v"
                " (job, through, removals_through, tables) VALUES (%s, %s, %s, {tables})"
                " ON CONFLICT (job) DO UPDATE SET through = excluded.through,"
                " removals_through = excluded.removals_through, tables = excluded.tables,"
                " verified_at = now()"
            ).format(tables=_TABLES),
            (ledger.job, through, removals_through),
        ),
        epoch,
    )
