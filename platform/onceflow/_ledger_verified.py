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
does every other way a whole table can go (the notes' own table included). In each such
case the next start-up checks everything again, as it did before it had a verified point.
A start-up consumes the notes it read once its checks have passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg import sql

if TYPE_CHECKING:
    import psycopg

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


@dataclass(frozen=True)
class Notes:
    """The removal notes a start-up read: consumed once its checks have passed."""

    ids: tuple[int, ...]  # the job's own notes
    truncations: tuple[int, ...]  # every `TRUNCATE` noted (they name no job)


def read(ledger: Ledger) -> tuple[Verified | None, Notes]:
    """The job's verified point (None when everything must be checked: none recorded, a table
    created again since, or a table emptied by a `TRUNCATE` not seen yet) and the notes read."""
    query = sql.SQL(
        "SELECT v.through, v.tables = {tables}, v.truncations_seen,"
        " (SELECT coalesce(array_agg(r.id), '{{}}') FROM onceflow.ledger_removals r"
        "  WHERE r.job = %(job)s),"
        " (SELECT coalesce(array_agg(DISTINCT r.window_id), '{{}}')"
        "  FROM onceflow.ledger_removals r WHERE r.job = %(job)s),"
        " (SELECT coalesce(array_agg(r.id), '{{}}') FROM onceflow.ledger_removals r"
        "  WHERE r.job IS NULL)"
        " FROM (SELECT 1) AS one LEFT JOIN onceflow.ledger_verified v ON v.job = %(job)s"
    ).format(tables=_TABLES)
    row = ledger.read(
        "read the ledger's verified point",
        lambda conn: conn.execute(query, {"job": ledger.job}).fetchone(),  # type: ignore[arg-type]
    )
    assert row is not None  # one row, from `one`
    through, same_tables, seen, ids, removed, truncations = row
    notes = Notes(tuple(int(i) for i in ids), tuple(int(i) for i in truncations))
    # `same_tables` is NULL when no point is recorded or a table is missing.
    if through is None or not same_tables or set(notes.truncations) - set(seen or ()):
        return None, notes
    return Verified(int(through), frozenset(int(w) for w in removed if w is not None)), notes


def removed_since(ledger: Ledger, notes: Notes) -> bool:
    """Whether rows of the job's ledger were removed since `notes` were read (a note that is
    not among them: its own, or a `TRUNCATE`). A removal that made a read miss a row committed
    before that read, so a check after the read sees its note."""
    row = ledger.read(
        "look for ledger rows removed under the run",
        lambda conn: conn.execute(
            "SELECT EXISTS (SELECT 1 FROM onceflow.ledger_removals"
            " WHERE (job = %s OR job IS NULL) AND NOT (id = ANY(%s)))",
            (ledger.job, [*notes.ids, *notes.truncations]),
        ).fetchone(),
    )
    return bool(row and row[0])


def record(ledger: Ledger, epoch: int, through: int, notes: Notes) -> None:
    """Record that the ledger was checked whole through window `through`, and consume the
    notes read before the checks (notes made meanwhile stay for the next start-up: they are
    consumed by id, never by a watermark a slower transaction could commit below)."""

    def write(conn: psycopg.Connection) -> None:
        conn.execute(
            sql.SQL(
                "INSERT INTO onceflow.ledger_verified AS v"
                " (job, through, tables, truncations_seen) VALUES (%s, %s, {tables}, %s)"
                " ON CONFLICT (job) DO UPDATE SET through = excluded.through,"
                " tables = excluded.tables, truncations_seen = excluded.truncations_seen,"
                " verified_at = now()"
            ).format(tables=_TABLES),
            (ledger.job, through, list(notes.truncations)),
        )
        if notes.ids:
            conn.execute(
                "DELETE FROM onceflow.ledger_removals WHERE job = %s AND id = ANY(%s)",
                (ledger.job, list(notes.ids)),
            )

    ledger.write("record the ledger's verified point", write, epoch)
