"""The PostgreSQL sinks' commit markers past the job's detail horizon, folded into range rows.

A marker per window and sink (`onceflow.sink_commits`, `_markers`) answers which windows a
sink holds and is the record a lost ledger is rebuilt from; kept a row per window for good, its
copies of each window's offsets were half of what the ledger keeps. Maintenance folds the
markers of the windows through the detail horizon (`onceflow.maintain._detail`) into
`onceflow.sink_commits_folded`: one row per sink and run of windows, holding its first and
last window, the windows between them without a marker (`lacking`), the sums the readers ask
for (rows written, the highest epoch) and every folded marker whole (window, epoch,
transaction id, run, offsets, rows, commit time) as gzip-compressed JSON lines, which only a
rebuild reads.

Every reader of the markers reads the folded rows too (the queries below): which windows a
sink holds, its last window and highest epoch, the counts and sums of the reconcile baseline
and of the quality suites, the windows a rebuild puts back. What no longer has a row of its
own is a folded window's marker: the lineage view shows no transaction id for it (its lineage
rows went at the same horizon).

Folding is safe for the commit protocol: every window through the horizon is completed or
skipped, so none is being committed, and the fold runs in the ledger's transaction that holds
the job's row, as every commit does. A marker check of the commit path still sees a folded
window (`Marker.exists`), so such a window is never applied twice.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql

FOLDED_DDL = """
CREATE TABLE IF NOT EXISTS onceflow.sink_commits_folded (
    job text NOT NULL,
    sink text NOT NULL,
    first_window bigint NOT NULL,
    last_window bigint NOT NULL,
    lacking bigint[] NOT NULL,
    rows_written numeric NOT NULL,
    max_epoch bigint NOT NULL,
    records bytea NOT NULL,
    folded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink, first_window)
);
-- A window above every folded one (every commit's marker check) is one probe of this index.
CREATE INDEX IF NOT EXISTS sink_commits_folded_by_last
    ON onceflow.sink_commits_folded (job, sink, last_window);
"""

# A gap longer than this between two folded markers of a sink starts a new row, so `lacking`
# stays short (a late marker far below the rest folds into a row of its own).
MAX_GAP = 64


def fold(conn: psycopg.Connection, job: str, sinks: Sequence[str], through: int) -> int:
    """Fold the markers of `sinks` for windows through `through` into range rows, in the
    caller's transaction (which holds the job's row); return the markers folded."""
    markers = conn.execute(
        "DELETE FROM onceflow.sink_commits WHERE job = %s AND sink = ANY(%s) AND window_id <= %s"
        " RETURNING sink, window_id, epoch, xid::text, run_id, offsets, rows_written,"
        " committed_at",
        (job, list(sinks), through),
    ).fetchall()
    by_sink: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for marker in markers:
        by_sink[str(marker[0])].append(marker)
    for sink, rows in by_sink.items():
        for run in _runs(sorted(rows, key=lambda r: int(r[1]))):
            ids = [int(r[1]) for r in run]
            present = set(ids)
            conn.execute(
                "INSERT INTO onceflow.sink_commits_folded (job, sink, first_window,"
                " last_window, lacking, rows_written, max_epoch, records)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    job,
                    sink,
                    ids[0],
                    ids[-1],
                    [w for w in range(ids[0], ids[-1] + 1) if w not in present],
                    sum(int(r[6]) for r in run),
                    max(int(r[2]) for r in run),
                    _pack(run),
                ),
            )
    return len(markers)


def _runs(rows: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    """`rows` (sorted by window) cut where two windows are more than `MAX_GAP` apart."""
    run: list[tuple[Any, ...]] = []
    for row in rows:
        if run and int(row[1]) - int(run[-1][1]) > MAX_GAP:
            yield run
            run = []
        run.append(row)
    if run:
        yield run


def _pack(rows: list[tuple[Any, ...]]) -> bytes:
    lines = (
        json.dumps(
            {
                "window": int(w),
                "epoch": int(e),
                "xid": xid,
                "run_id": run_id,
                "offsets": offsets,
                "rows": int(n),
                "committed_at": at.isoformat(),
            },
            separators=(",", ":"),
        )
        for _, w, e, xid, run_id, offsets, n, at in rows
    )
    return gzip.compress("\n".join(lines).encode(), mtime=0)


def folded_records(
    conn: psycopg.Connection, job: str, sinks: Sequence[str], after: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(sink, marker) of every folded marker of `sinks` for a window above `after`."""
    rows = conn.execute(
        "SELECT sink, records FROM onceflow.sink_commits_folded"
        " WHERE job = %s AND sink = ANY(%s) AND last_window > %s ORDER BY sink, first_window",
        (job, list(sinks), after),
    ).fetchall()
    for sink, records in rows:
        for line in gzip.decompress(bytes(records)).decode().splitlines():
            marker = json.loads(line)
            if int(marker["window"]) > after:
                yield str(sink), marker


def marker_holds(conn: psycopg.Connection, job: str, sink: str, window_id: int) -> bool:
    """Whether a marker of the sink, folded or not, holds the window (one round trip: every
    commit asks it of a window that has none)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM onceflow.sink_commits"
        "  WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s)"
        " OR EXISTS (SELECT 1 FROM onceflow.sink_commits_folded f"
        "  WHERE f.job = %(job)s AND f.sink = %(sink)s AND f.last_window >= %(w)s"
        "  AND f.first_window <= %(w)s AND %(w)s <> ALL(f.lacking))",
        {"job": job, "sink": sink, "w": window_id},
    ).fetchone()
    return bool(row and row[0])


# The pairs (sink, window) asked for that no marker and no folded row holds: a probe of the
# markers' key per pair (a year of windows every sink holds is an empty answer), then the
# folded windows in the asked range taken away as a set (a full reconcile asks for every
# window of the history: not a probe of the folded rows per pair).
_LACKING = """
SELECT s, w FROM unnest(%(sinks)s::text[]) AS s, unnest(%(ids)s::bigint[]) AS w
WHERE NOT EXISTS (SELECT 1 FROM onceflow.sink_commits c
                  WHERE c.job = %(job)s AND c.sink = s AND c.window_id = w)
EXCEPT
SELECT f.sink, g FROM onceflow.sink_commits_folded f,
    generate_series(greatest(f.first_window, %(lo)s), least(f.last_window, %(hi)s)) AS g
WHERE f.job = %(job)s AND f.sink = ANY(%(sinks)s) AND f.last_window >= %(lo)s
    AND f.first_window <= %(hi)s AND g <> ALL(f.lacking)
"""


def lacking(
    conn: psycopg.Connection, job: str, sinks: Sequence[str], ids: Sequence[int]
) -> list[tuple[str, int]]:
    """The pairs (sink, window) of `sinks` × `ids` (sorted) that no marker holds."""
    if not ids or not sinks:
        return []
    asked = {"sinks": list(sinks), "ids": list(ids), "job": job, "lo": ids[0], "hi": ids[-1]}
    return [(str(s), int(w)) for s, w in conn.execute(_LACKING, asked).fetchall()]


# Per sink: the windows held (markers and folded), the last one, the highest epoch.
SUMMARY = """
SELECT sink, sum(windows)::bigint, max(last_window), max(max_epoch) FROM (
    SELECT sink, count(*) AS windows, max(window_id) AS last_window, max(epoch) AS max_epoch
    FROM onceflow.sink_commits WHERE job = %(job)s AND sink = ANY(%(sinks)s) GROUP BY sink
    UNION ALL
    SELECT sink, sum(last_window - first_window + 1 - cardinality(lacking)), max(last_window),
        max(max_epoch)
    FROM onceflow.sink_commits_folded WHERE job = %(job)s AND sink = ANY(%(sinks)s)
    GROUP BY sink
) AS held GROUP BY sink
"""


def held_count(job: str, sink: str, through: sql.Composable) -> sql.Composable:
    """An SQL expression: how many windows through `through` the sink's markers hold."""
    return sql.SQL(
        "((SELECT count(*) FROM onceflow.sink_commits WHERE job = {job} AND sink = {sink}"
        " AND window_id <= {through}) + coalesce((SELECT sum(least(f.last_window, {through})"
        " - f.first_window + 1 - (SELECT count(*) FROM unnest(f.lacking) AS x"
        " WHERE x <= {through})) FROM onceflow.sink_commits_folded f WHERE f.job = {job}"
        " AND f.sink = {sink} AND f.first_window <= {through}), 0))::bigint"
    ).format(job=sql.Literal(job), sink=sql.Literal(sink), through=through)


def held_count_and_sum(job: str, sink: str, through: sql.Composable) -> sql.Composable:
    """Two SQL expressions: how many windows through `through` the sink holds, and the sum of
    their ids (the reconcile baseline's check that they are the ones it stood for)."""
    last = sql.SQL("least(f.last_window, {})").format(through)
    lacking = sql.SQL("(SELECT {agg} FROM unnest(f.lacking) AS x WHERE x <= {through})")
    folded = sql.SQL(
        "FROM onceflow.sink_commits_folded f WHERE f.job = {job} AND f.sink = {sink}"
        " AND f.first_window <= {through}"
    ).format(job=sql.Literal(job), sink=sql.Literal(sink), through=through)
    marked = sql.SQL(
        "FROM onceflow.sink_commits WHERE job = {job} AND sink = {sink} AND window_id <= {through}"
    ).format(job=sql.Literal(job), sink=sql.Literal(sink), through=through)
    total = sql.SQL(
        "((SELECT coalesce(sum(window_id), 0) {marked})"
        " + coalesce((SELECT sum(div((f.first_window + {last})::numeric"
        " * ({last} - f.first_window + 1), 2) - {s}) {folded}), 0))"
    ).format(
        marked=marked,
        last=last,
        s=lacking.format(agg=sql.SQL("coalesce(sum(x), 0)"), through=through),
        folded=folded,
    )
    return sql.SQL("{}, {}").format(held_count(job, sink, through), total)
