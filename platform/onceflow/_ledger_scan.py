"""The ledger's answers in aggregate, so start-up, `status` and the lacking-windows check cost
the same after a year of windows as after a hundred.

Each query here is answered on the server from the `windows` primary key (job, window_id) or a
filtered scan, and returns a handful of rows: a count, the windows above a point, the few
pending or skipped ones. Nothing materialises every window of the job in Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import sql

from onceflow import _ledger_verified as ledger_verified

if TYPE_CHECKING:
    from onceflow._ledger_verified import Verified
    from onceflow.ledger import Ledger, Window


def _windows(ledger: Ledger, where: str, params: Sequence[Any], what: str) -> list[Window]:
    # `where` is one of this module's constant conditions, never input.
    return ledger.windows_where(sql.SQL(where), params, what)  # type: ignore[arg-type]


def contiguous_through(ledger: Ledger, verified: Verified | None = None) -> int:
    """The highest k such that the ledger has every window 1..k (0 when window 1 is missing).

    Window ids are dense from 1, so a count equal to the highest id means no gap: one
    index-only aggregate, over the windows above the verified point when no window was
    removed since (`_ledger_verified`). Only a ledger that lost rows pays for finding its
    first gap."""
    if verified is not None and not verified.removed:
        row = ledger.read(
            "count the windows above the verified point",
            lambda conn: conn.execute(
                "SELECT count(*), coalesce(max(window_id), %s) FROM onceflow.windows"
                " WHERE job = %s AND window_id > %s",
                (verified.through, ledger.job, verified.through),
            ).fetchone(),
        )
        if row and int(row[0]) == int(row[1]) - verified.through:
            return int(row[1])
    row = ledger.read(
        "count the windows",
        lambda conn: conn.execute(
            "SELECT count(*), coalesce(max(window_id), 0) FROM onceflow.windows WHERE job = %s",
            (ledger.job,),
        ).fetchone(),
    )
    count, top = (int(row[0]), int(row[1])) if row else (0, 0)
    if count == top:
        return top
    row = ledger.read(
        "find the first missing window",
        lambda conn: conn.execute(
            "SELECT coalesce(min(w.window_id), 0) FROM onceflow.windows w"
            " WHERE w.job = %(job)s AND NOT EXISTS (SELECT 1 FROM onceflow.windows n"
            "   WHERE n.job = %(job)s AND n.window_id = w.window_id + 1)"
            " AND EXISTS (SELECT 1 FROM onceflow.windows f"
            "   WHERE f.job = %(job)s AND f.window_id = 1)",
            {"job": ledger.job},
        ).fetchone(),
    )
    return int(row[0]) if row else 0


@dataclass(frozen=True)
class KnownWindows(Set[int]):
    """The window ids a ledger has: every id through `through`, and `above` beyond it."""

    through: int
    above: frozenset[int]

    def __contains__(self, item: object) -> bool:
        return isinstance(item, int) and (1 <= item <= self.through or item in self.above)

    def __iter__(self) -> Iterator[int]:
        yield from range(1, self.through + 1)
        yield from sorted(self.above)

    def __len__(self) -> int:
        return self.through + len(self.above)

    def missing(self, upto: int) -> list[int]:
        """The ids in 1..upto that are not known (only those above `through` are looked at)."""
        return [w for w in range(self.through + 1, upto + 1) if w not in self.above]

    def with_ids(self, ids: Set[int]) -> KnownWindows:
        return KnownWindows(self.through, self.above | {w for w in ids if w > self.through})


def known_windows(ledger: Ledger, verified: Verified | None = None) -> KnownWindows:
    """Which windows the ledger has, read as one count and the ids above the first gap."""
    through = contiguous_through(ledger, verified)
    rows = ledger.read(
        "read the window ids above the first gap",
        lambda conn: conn.execute(
            "SELECT window_id FROM onceflow.windows WHERE job = %s AND window_id > %s",
            (ledger.job, through),
        ).fetchall(),
    )
    return KnownWindows(through, frozenset(int(w) for (w,) in rows))


def unindexed_windows(ledger: Ledger, verified: Verified | None = None) -> list[Window]:
    """Windows without a row in the unit index (`source_units` lost on its own): an anti-join
    on the server, empty when the index is whole; with a verified point, of the windows above
    it and those whose rows were removed since."""
    where = (
        "NOT EXISTS (SELECT 1 FROM onceflow.source_units u"
        " WHERE u.job = w.job AND u.window_id = w.window_id)"
    )
    if verified is None:
        return _windows(ledger, where, (), "read the windows missing from the unit index")
    return _windows(
        ledger,
        where + " AND (w.window_id > %s OR w.window_id = ANY(%s))",
        (verified.through, sorted(verified.removed)),
        "read the windows missing from the unit index",
    )


def windows_above(ledger: Ledger, floor: int, *, completed_only: bool = False) -> list[Window]:
    """The windows with an id above `floor` (only completed ones if asked)."""
    where = "window_id > %s" + (" AND completed_at IS NOT NULL" if completed_only else "")
    return _windows(ledger, where, (floor,), "read the newest windows")


def windows_of_units(ledger: Ledger, units: Sequence[str]) -> list[Window]:
    """The windows that took any of `units` (through the unit index)."""
    if not units:
        return []
    # Not correlated with `w`: a subquery per window, each probing every listed unit, took
    # minutes at 100,000 kept files; this one looks the units up once, by the unit index.
    return _windows(
        ledger,
        "window_id IN (SELECT DISTINCT u.window_id FROM unnest(%s::text[]) AS x(unit)"
        " JOIN onceflow.source_units u ON u.job = %s AND u.unit = x.unit)",
        (list(units), ledger.job),
        "read the windows of the listed input",
    )


@dataclass(frozen=True)
class WindowSummary:
    """What `status` says about all windows, aggregated on the server."""

    count: int
    last: int
    pending: list[int]
    skipped: list[tuple[int, str]]
    recent: list[Window]


def window_summary(ledger: Ledger, recent: int) -> WindowSummary:
    """The count, the last id, the pending and skipped windows, and the `recent` newest.

    Counted above the ledger's verified point when no window was removed since (every window
    up to it is there, `_ledger_verified`), else over every window."""
    verified, _ = ledger_verified.read(ledger)
    floor = verified.through if verified is not None and not verified.removed else 0
    row = ledger.read(
        "summarise the windows",
        lambda conn: conn.execute(
            "SELECT count(*), coalesce(max(window_id), %s) FROM onceflow.windows"
            " WHERE job = %s AND window_id > %s",
            (floor, ledger.job, floor),
        ).fetchone(),
    )
    count, last = (floor + int(row[0]), int(row[1])) if row else (floor, floor)
    rows = ledger.read(
        "read the pending and skipped windows",
        lambda conn: conn.execute(
            "SELECT window_id, skip_reason FROM onceflow.windows WHERE job = %s"
            " AND (completed_at IS NULL OR skip_reason IS NOT NULL) ORDER BY window_id",
            (ledger.job,),
        ).fetchall(),
    )
    pending, skipped = [], []
    for wid, reason in rows:
        if reason is None:
            pending.append(int(wid))
        else:
            skipped.append((int(wid), str(reason)))
    newest = _windows(
        ledger,
        "window_id IN (SELECT window_id FROM onceflow.windows WHERE job = %s"
        " ORDER BY window_id DESC LIMIT %s)",
        (ledger.job, recent),
        "read the newest windows",
    )
    return WindowSummary(count, last, pending, skipped, newest)


def orphaned_windows(ledger: Ledger, verified: Verified | None = None) -> list[int]:
    """Window ids the unit index names that are not planned windows (the plan lost them);
    with a verified point (`_ledger_verified`), among the ids above it and those whose rows
    were removed since."""
    where = sql.SQL("")
    params: tuple[Any, ...] = (ledger.job,)
    if verified is not None:
        where = sql.SQL(" AND (u.window_id > %s OR u.window_id = ANY(%s))")
        params += (verified.through, sorted(verified.removed))
    query = sql.SQL(
        "SELECT DISTINCT u.window_id FROM onceflow.source_units u WHERE u.job = %s{}"
        " AND NOT EXISTS (SELECT 1 FROM onceflow.windows w"
        "                 WHERE w.job = u.job AND w.window_id = u.window_id)"
        " ORDER BY 1"
    ).format(where)
    rows = ledger.read("read the unit index", lambda conn: conn.execute(query, params).fetchall())
    return [int(w) for (w,) in rows]
