"""The PostgreSQL sinks' held floor: the point the last passed check of what they hold verified.

A run's start-up checks that every sink holds every completed window (`runs.holds`), so a
lost sink table or lost markers are found before anything is computed. Asked about every
window ever, that check grows with the history (the ledger's completed windows read, and a
marker probe for each). Once it has passed, `onceflow.sink_commits_verified` keeps, per sink,
the window it checked through and how many windows through it the sink's markers (folded or
not) named just before the check; the next check asks only about the windows above that
point, while

- the count is unchanged: a marker removed, by hand or by a restore, or one written later
  below the point (a replay), changes it, and the next check asks about every window again;
- no sink's table was replaced (`PostgresGroup._replaced`): a dropped table is never trusted.

The count is one index-only scan per sink on the server (and a sum over the folded rows),
not a window list sent to the client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from onceflow.sinks.postgres._folded import held_count

VERIFIED_DDL = """
CREATE TABLE IF NOT EXISTS onceflow.sink_commits_verified (
    job text NOT NULL,
    sink text NOT NULL,
    through bigint NOT NULL,
    windows bigint NOT NULL,
    verified_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
"""


def marker_counts(
    conn: psycopg.Connection, job: str, sinks: Sequence[str], through: int, above: int = 0
) -> dict[str, int]:
    """For each sink, the windows in `above + 1 .. through` its markers (folded or not) name."""
    out = {}
    for sink in sinks:
        query = sql.SQL("SELECT {}").format(held_count(job, sink, sql.Literal(through)))
        row = conn.execute(query).fetchone()
        out[sink] = int(row[0]) if row else 0
        if above:
            query = sql.SQL("SELECT {}").format(held_count(job, sink, sql.Literal(above)))
            row = conn.execute(query).fetchone()
            out[sink] -= int(row[0]) if row else 0
    return out


def record(conn: psycopg.Connection, job: str, through: int, counts: Mapping[str, int]) -> None:
    """Keep the point a passed check verified, with the counts taken before it."""
    for sink, windows in counts.items():
        conn.execute(
            "INSERT INTO onceflow.sink_commits_verified (job, sink, through, windows)"
            " VALUES (%s, %s, %s, %s) ON CONFLICT (job, sink) DO UPDATE SET"
            " through = excluded.through, windows = excluded.windows, verified_at = now()",
            (job, sink, through, windows),
        )


def floor(conn: psycopg.Connection, job: str, sinks: Sequence[str]) -> HeldPoints | None:
    """The points recorded for `sinks` whose counts still hold (None: ask about every
    window)."""
    rows = conn.execute(
        "SELECT s, v.through, v.windows FROM unnest(%s::text[]) AS s"
        " LEFT JOIN onceflow.sink_commits_verified v ON v.job = %s AND v.sink = s",
        (list(sinks), job),
    ).fetchall()
    counts = {}
    for sink, through, windows in rows:
        if through is None:
            return None
        if marker_counts(conn, job, [str(sink)], int(through))[str(sink)] != int(windows):
            return None
        counts[str(sink)] = (int(through), int(windows))
    return HeldPoints(counts)


@dataclass(frozen=True)
class HeldPoints:
    """Per sink, the window a passed check verified through and its markers' count then."""

    points: dict[str, tuple[int, int]]

    @property
    def through(self) -> int:
        return min((t for t, _ in self.points.values()), default=0)

    def count_from(self, conn: psycopg.Connection, job: str, through: int) -> dict[str, int]:
        """The counts through `through` (at or above every point): each point's, and a count
        of the markers above it (not every marker again)."""
        out = {}
        for sink, (point, windows) in self.points.items():
            if through < point:
                out.update(marker_counts(conn, job, [sink], through))
            else:
                out[sink] = windows + marker_counts(conn, job, [sink], through, point)[sink]
        return out
