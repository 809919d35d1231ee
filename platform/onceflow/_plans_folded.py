"""The windows' plans past the job's detail horizon, folded into range rows.

A window's row in `onceflow.windows` holds its plan (`offsets`: the input it reads) and its
`stats` (the counts the lineage view and the Delta quality suite read); together they were
four fifths of the row, kept for every window ever. Maintenance folds them for the windows
through the detail horizon (`onceflow.maintain._detail`): the row stays (its id, epoch, times
and skip: every count, gap and epoch check of the ledger reads those), its `offsets` and `stats`
are set to NULL, and `onceflow.window_plans_folded` gets a row per 1,000 of them: the first and
last window, the windows folded, the skipped ones, the sums per output the quality suite asks for,
and every folded plan whole (window, offsets, stats) as gzip-compressed JSON lines.

A row with NULL `offsets` is folded. Every reader of a plan fills it from the folded rows
(`unfold`, used by `Ledger.windows`, `Ledger.window`, the ledger's scans and the lineage view),
so a replay, a restatement, a reconcile and `status` see the plan as it was; the Delta quality
suite sums the folded outputs (`output_sums`). Folding changes nothing a commit reads: every
window through the horizon is completed or skipped, and the fold runs in the transaction that
holds the job's row. A folded window counted again (a restatement, a replay) has its stats
written into its folded record (`record_stats`).

A windows row put back after a lost plan (`Ledger.restore_window`) has its offsets again; the
folded row that named it is then stale for that window and no longer read for it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from onceflow.errors import LedgerError
from onceflow.windows import format_windows

FOLDED_DDL = """
CREATE TABLE IF NOT EXISTS onceflow.window_plans_folded (
    job text NOT NULL,
    first_window bigint NOT NULL,
    last_window bigint NOT NULL,
    windows integer NOT NULL,
    skipped bigint[] NOT NULL,
    outputs jsonb NOT NULL,
    records bytea NOT NULL,
    folded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, first_window)
);
CREATE INDEX IF NOT EXISTS window_plans_folded_by_last
    ON onceflow.window_plans_folded (job, last_window);
"""


# Windows a folded row holds at most: a reader of one plan decompresses its row (about 1 ms
# for 1,000 windows; 5 ms for 5,000), while gzip gains little beyond a few hundred lines.
ROW_WINDOWS = 1_000


@dataclass(frozen=True)
class Plan:
    """A folded window's plan as it was when folded."""

    window_id: int
    offsets: dict[str, Any]
    stats: dict[str, Any] | None


def fold(conn: psycopg.Connection, job: str, through: int) -> int:
    """Fold the plans of `job`'s windows through `through` not folded yet, in the caller's
    transaction (which holds the job's row); return the windows folded."""
    rows = conn.execute(
        "WITH f AS (SELECT window_id, offsets, stats, skipped_at IS NOT NULL AS skipped"
        "  FROM onceflow.windows WHERE job = %(job)s AND window_id <= %(through)s"
        # Locked: a replay's `record_stats` of one of them is waited for and its stats read.
        "  AND offsets IS NOT NULL FOR UPDATE),"
        " u AS (UPDATE onceflow.windows w SET offsets = NULL, stats = NULL FROM f"
        "  WHERE w.job = %(job)s AND w.window_id = f.window_id)"
        " SELECT window_id, offsets, stats, skipped FROM f ORDER BY window_id",
        {"job": job, "through": through},
    ).fetchall()
    if not rows:
        return 0
    plans = [Plan(int(w), dict(o), s) for w, o, s, _ in rows]
    skipped = [int(w) for w, _, _, s in rows if s]
    first, last = plans[0].window_id, plans[-1].window_id
    # Folded rows this range meets are stale only where their windows were put back with their
    # plans (a lost `windows` table rebuilt); what they still hold folded joins this row.
    older = conn.execute(
        "DELETE FROM onceflow.window_plans_folded WHERE job = %s AND first_window <= %s"
        " AND last_window >= %s RETURNING records, skipped, folded_at",
        (job, last, first),
    ).fetchall()
    older.sort(key=lambda r: r[2])  # a window two of them name: the newest record
    if older:
        still = _still_folded(conn, job, {p.window_id for p in plans}, older)
        plans = sorted([*plans, *still], key=lambda p: p.window_id)
        skipped = [*skipped, *(int(w) for _, s, _ in older for w in s)]
    gone = set(skipped)
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO onceflow.window_plans_folded (job, first_window, last_window, windows,"
            " skipped, outputs, records) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            [
                (
                    job,
                    part[0].window_id,
                    part[-1].window_id,
                    len(part),
                    [p.window_id for p in part if p.window_id in gone],
                    json.dumps(_output_sums(part, gone)),
                    _pack(part),
                )
                for part in (plans[i : i + ROW_WINDOWS] for i in range(0, len(plans), ROW_WINDOWS))
            ],
        )
    return len(rows)


def record_stats(conn: psycopg.Connection, job: str, window_id: int, stats: dict[str, Any]) -> bool:
    """Put `stats` in folded window `window_id`'s record (a restatement or a replay counted it
    again), in the caller's transaction; False when no folded row names the window."""
    row = conn.execute(
        "SELECT first_window, records, skipped FROM onceflow.window_plans_folded"
        " WHERE job = %s AND first_window <= %s AND last_window >= %s"
        " ORDER BY folded_at DESC, first_window DESC LIMIT 1 FOR UPDATE",
        (job, window_id, window_id),
    ).fetchone()
    if row is None:
        return False
    first, records, skipped = row
    plans = [
        Plan(p.window_id, p.offsets, stats) if p.window_id == window_id else p
        for p in _unpack(records)
    ]
    conn.execute(
        "UPDATE onceflow.window_plans_folded SET records = %s, outputs = %s"
        " WHERE job = %s AND first_window = %s",
        (
            _pack(plans),
            json.dumps(_output_sums(plans, {int(w) for w in skipped})),
            job,
            first,
        ),
    )
    return True


def _still_folded(
    conn: psycopg.Connection, job: str, folding: set[int], older: list[tuple[Any, ...]]
) -> list[Plan]:
    """The plans of `older` rows whose windows are still folded (not being folded again)."""
    newest = {p.window_id: p for records, *_ in older for p in _unpack(records)}
    plans = [p for w, p in sorted(newest.items()) if w not in folding]
    if not plans:
        return []
    rows = conn.execute(
        "SELECT window_id FROM onceflow.windows WHERE job = %s AND window_id = ANY(%s)"
        " AND offsets IS NULL",
        (job, [p.window_id for p in plans]),
    ).fetchall()
    folded = {int(w) for (w,) in rows}
    return [p for p in plans if p.window_id in folded]


def _output_sums(plans: Iterable[Plan], skipped: set[int]) -> dict[str, list[int]]:
    """Output → [windows that counted it, rows], over the windows not skipped."""
    sums: dict[str, list[int]] = {}
    for plan in plans:
        if plan.window_id in skipped:
            continue
        for name in (plan.stats or {}).get("outputs") or {}:
            rows = _count(plan, str(name))
            if rows is not None:
                entry = sums.setdefault(str(name), [0, 0])
                entry[0] += 1
                entry[1] += rows
    return sums


def _pack(plans: Iterable[Plan]) -> bytes:
    lines = (
        json.dumps(
            {"window": p.window_id, "offsets": p.offsets, "stats": p.stats},
            separators=(",", ":"),
        )
        for p in plans
    )
    return gzip.compress("\n".join(lines).encode(), mtime=0)


_LINE_START = '{"window":'


def _unpack(records: Any, only: Collection[int] | None = None) -> list[Plan]:
    """The plans of a folded row (those of `only` if given: the rest are not parsed)."""
    out = []
    for line in gzip.decompress(bytes(records)).decode().splitlines():
        if only is not None:
            # Each line starts with its window (`_pack`): 5,000 parsed to read one cost 30 ms.
            end = line.index(",", len(_LINE_START))
            if int(line[len(_LINE_START) : end]) not in only:
                continue
        entry = json.loads(line)
        out.append(Plan(int(entry["window"]), dict(entry["offsets"]), entry["stats"]))
    return out


def unfold(conn: psycopg.Connection, job: str, window_ids: Iterable[int]) -> dict[int, Plan]:
    """The folded plans of `window_ids` (windows whose row holds no offsets), read from the
    folded rows that cover them, the newest for a window named by two."""
    wanted = sorted(set(window_ids))
    if not wanted:
        return {}
    rows = conn.execute(
        "SELECT records FROM onceflow.window_plans_folded f"
        " WHERE job = %s AND last_window >= %s AND first_window <= %s"
        " AND EXISTS (SELECT 1 FROM unnest(%s::bigint[]) AS w(id)"
        "             WHERE w.id BETWEEN f.first_window AND f.last_window)"
        " ORDER BY folded_at, first_window",
        (job, wanted[0], wanted[-1], wanted),
    ).fetchall()
    asked = set(wanted)
    found: dict[int, Plan] = {}
    for (records,) in rows:
        for plan in _unpack(records, asked):
            found[plan.window_id] = plan
    missing = [w for w in wanted if w not in found]
    if missing:
        raise LedgerError(
            f"job {job!r}: the plans of windows {format_windows(missing)} were folded past the detail "
            "horizon, and onceflow.window_plans_folded no longer holds them. Restore that "
            "table from a backup of the ledger; nothing was computed."
        )
    return found


_WINDOW_ROWS = (
    "SELECT window_id, offsets, stats, epoch, completed_at IS NOT NULL, skip_reason"
    " FROM onceflow.windows w WHERE job = %s AND {} ORDER BY window_id"
)


def window_rows(
    conn: psycopg.Connection, job: str, where: sql.Composable, params: Sequence[Any]
) -> list[tuple[Any, ...]]:
    """(window_id, offsets, stats, epoch, completed, skip_reason) of `job`'s windows matching
    `where`, in order, each folded plan put back."""
    query = sql.SQL(_WINDOW_ROWS).format(where)  # type: ignore[arg-type]
    return fill(conn, job, conn.execute(query, (job, *params)).fetchall())


def fill(conn: psycopg.Connection, job: str, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """`rows` of (window_id, offsets, stats, ...) with each folded window's offsets and stats
    put back from its folded row."""
    folded = [int(r[0]) for r in rows if r[1] is None]
    if not folded:
        return rows
    plans = unfold(conn, job, folded)
    return [
        (r[0], plans[int(r[0])].offsets, plans[int(r[0])].stats, *r[3:]) if r[1] is None else r
        for r in rows
    ]


@dataclass(frozen=True)
class OutputSums:
    """What the folded windows through a point add to a Delta sink's expected row count.

    Attributes:
        without_count: Folded windows (not skipped nor abandoned) whose stats lack the output.
        rows: The output's rows over the folded windows not skipped nor abandoned.
        abandoned_rows: The output's rows over the folded windows abandoned for the sink.
    """

    without_count: int = 0
    rows: int = 0
    abandoned_rows: int = 0


def output_sums(
    conn: psycopg.Connection,
    job: str,
    output: str,
    abandoned: Collection[int],
    through: int | None = None,
) -> OutputSums:
    """`output`'s counts over `job`'s folded windows through `through` (every one when None),
    `abandoned` the windows abandoned for the sink. From each folded row's sums where it holds
    every window it names and none is abandoned or past `through`; from its plans otherwise."""
    top = through if through is not None else 2**62
    row = conn.execute(
        "SELECT count(*) FROM onceflow.windows WHERE job = %s AND window_id <= %s"
        " AND offsets IS NULL",
        (job, top),
    ).fetchone()
    folded_here = int(row[0]) if row else 0
    if not folded_here:
        return OutputSums()
    rows = conn.execute(
        "SELECT first_window, last_window, windows, skipped, outputs"
        " FROM onceflow.window_plans_folded WHERE job = %s AND first_window <= %s",
        (job, top),
    ).fetchall()
    whole = all(int(last) <= top for _, last, _, _, _ in rows) and folded_here == sum(
        int(n) for _, _, n, _, _ in rows
    )
    if whole and not any(
        any(int(first) <= w <= int(last) for w in abandoned) for first, last, _, _, _ in rows
    ):
        counted = sum(int((outputs.get(output) or [0, 0])[0]) for *_, outputs in rows)
        return OutputSums(
            without_count=sum(int(n) - len(s) for _, _, n, s, _ in rows) - counted,
            rows=sum(int((outputs.get(output) or [0, 0])[1]) for *_, outputs in rows),
        )
    return _output_sums_by_window(conn, job, output, set(abandoned), top)


def _output_sums_by_window(
    conn: psycopg.Connection, job: str, output: str, abandoned: set[int], top: int
) -> OutputSums:
    ids = conn.execute(
        "SELECT window_id, skipped_at IS NOT NULL FROM onceflow.windows WHERE job = %s"
        " AND window_id <= %s AND offsets IS NULL",
        (job, top),
    ).fetchall()
    skipped = {int(w) for w, s in ids if s}
    without = rows = gap = 0
    for window_id, plan in unfold(conn, job, [int(w) for w, _ in ids]).items():
        count = _count(plan, output)
        if window_id in abandoned:
            gap += count or 0
        elif window_id not in skipped:
            if count is not None:
                rows += count
            else:
                without += 1
    return OutputSums(without, rows, gap)


def _count(plan: Plan, output: str) -> int | None:
    """`output`'s rows in the plan's stats (None when they hold no number for it)."""
    count = ((plan.stats or {}).get("outputs") or {}).get(output)
    return count if isinstance(count, int) and not isinstance(count, bool) else None
