"""A staged window moved into a sink's table inside the commit transaction, by the sink's mode
(append, upsert, accumulate), and a window's rows replaced by a restatement.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from onceflow._pgcopy import POSITION
from onceflow.errors import SinkError
from onceflow.sinks.postgres._accumulate import (
    accumulate,
    contribution,
    detail_pruned_through,
    forget_contribution,
    has_contribution,
    save_contribution,
    summed,
    target_table,
)
from onceflow.sinks.postgres.spec import PostgresSink


def apply_staged(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    positioned: bool = False,
    *,
    fresh: bool = False,
) -> tuple[int, int]:
    """Move the staged rows into the sink's table; return the rows written and added.

    `positioned`: the staging table holds the rows' `POSITION` columns too. `fresh`: an upsert
    sink's window is expected to bring only keys the table lacks, so it is inserted as it is
    (half an upsert's cost); a key the table holds, or two rows of one key, then makes the
    statement fail with `UniqueViolation` and the caller commits again without `fresh`."""
    if spec.mode == "accumulate":
        forget_contribution(conn, spec, job, window_id)
        return accumulate(conn, spec, summed(spec, staging), record=(job, window_id))
    cols = list(spec.columns)
    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
    target = target_table(spec)
    if spec.mode == "append":
        rows = conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                target, col_list, col_list, staging
            )
        ).rowcount
        return rows, rows
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    if spec.order_by is None:
        if not fresh:  # a fresh insert refuses a key's second row by itself
            _check_one_row_per_key(conn, spec, staging, job, window_id)
        rows = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(col_list, staging, keys)
    else:
        # One row per key: the greatest `order_by`, a tie to the later position.
        order = _latest_first(spec, positioned)
        _check_no_tie(conn, spec, staging, job, window_id, order, positioned)
        rows = sql.SQL("SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {}, {}").format(
            keys, col_list, staging, keys, order
        )
    if fresh:
        inserted = conn.execute(
            sql.SQL("INSERT INTO {} ({}) {}").format(target, col_list, rows)
        ).rowcount
        _require_key_index(conn, spec)
        return inserted, inserted
    others = [c for c in cols if c not in spec.key]
    action = (
        sql.SQL("DO UPDATE SET {}").format(
            sql.SQL(", ").join(
                sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                for c in others
            )
        )
        if others
        else sql.SQL("DO NOTHING")
    )
    later_window: sql.Composable = sql.SQL("true")
    if spec.window_column is not None:
        # The row of the latest window wins, also when an earlier window is restated (or
        # replayed) after a later one updated the same key.
        later_window = sql.SQL("COALESCE(t.{} <= EXCLUDED.{}, true)").format(
            sql.Identifier(spec.window_column), sql.Identifier(spec.window_column)
        )
    if others and spec.order_by is not None:
        # The greater `order_by` wins whichever window brings it (a late event never replaces
        # a newer row; a null is the least); on a tie, the later window.
        ob = sql.Identifier(spec.order_by)
        action = sql.SQL(
            "{} WHERE CASE WHEN EXCLUDED.{} IS NOT DISTINCT FROM t.{} THEN {}"
            " ELSE COALESCE(EXCLUDED.{} > t.{}, EXCLUDED.{} IS NOT NULL) END"
        ).format(action, ob, ob, later_window, ob, ob, ob)
    elif others and spec.window_column is not None:
        action = sql.SQL("{} WHERE {}").format(action, later_window)
    # xmax = 0 marks a row this statement inserted rather than replaced. In key order, the
    # index is walked page after page rather than at random (a sixth less time, measured).
    row = conn.execute(
        sql.SQL(
            "WITH w AS (INSERT INTO {} AS t ({}) {}"
            " ON CONFLICT ({}) {} RETURNING (xmax = 0) AS inserted)"
            " SELECT count(*), count(*) FILTER (WHERE inserted) FROM w"
        ).format(target, col_list, rows, keys, action)
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _require_key_index(conn: psycopg.Connection, spec: PostgresSink) -> None:
    """Only a unique index on the key makes a plain insert refuse a taken key: prove there is
    one, as an upsert's `ON CONFLICT` would (`InvalidColumnReference` if not). Asked after the
    insert, whose lock keeps the index from being dropped until the transaction ends."""
    names = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    nulls = sql.SQL(", ").join(
        sql.SQL("NULL::{}").format(sql.SQL(spec.columns[k])) for k in spec.key
    )
    conn.execute(
        sql.SQL(
            "EXPLAIN INSERT INTO {} ({}) SELECT {} WHERE false ON CONFLICT ({}) DO NOTHING"
        ).format(target_table(spec), names, nulls, names)
    )


def _check_one_row_per_key(
    conn: psycopg.Connection, spec: PostgresSink, staging: sql.Composable, job: str, window_id: int
) -> None:
    """An upsert takes one row per key from a window; two would leave the winner to chance."""
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    row = conn.execute(
        sql.SQL("SELECT count(*) - count(DISTINCT ({})) FROM {}").format(keys, staging)
    ).fetchone()
    extra = int(row[0]) if row else 0
    if extra:
        raise SinkError(
            f"sink {spec.name}: window {window_id}'s output `{spec.output}` has {extra} more "
            f"row(s) than keys {list(spec.key)}; an upsert sink takes one row per key per window. "
            "Nothing was written. Keep one row per key in the transform (or dedupe the job by "
            "that key), or let the sink pick one (`order_by=` a column: the greatest wins); "
            f"then `onceflow windows recompute {job} {window_id}` and run the job again."
        )


def _latest_first(spec: PostgresSink, positioned: bool) -> sql.Composable:
    """The ORDER BY that puts an `order_by` upsert's winning row of a key first."""
    assert spec.order_by is not None
    terms = [sql.SQL("{} DESC NULLS LAST").format(sql.Identifier(spec.order_by))]
    if positioned:
        terms += [sql.SQL("{} DESC NULLS LAST").format(sql.Identifier(c)) for c in POSITION]
    return sql.SQL(", ").join(terms)


def _check_no_tie(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    order: sql.Composable,
    positioned: bool,
) -> None:
    """Rows of one key that differ yet rank first together would leave the winner to chance."""
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    rows = conn.execute(
        sql.SQL(
            "SELECT {} FROM (SELECT *, rank() OVER (PARTITION BY {} ORDER BY {}) AS __rank"
            " FROM {}) AS s WHERE __rank = 1 GROUP BY {}"
            " HAVING count(DISTINCT ROW({})) > 1 LIMIT 5"
        ).format(
            keys,
            keys,
            order,
            staging,
            keys,
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns),
        )
    ).fetchall()
    if rows:
        named = "; ".join(
            ", ".join(f"{k}={v}" for k, v in zip(spec.key, r, strict=True)) for r in rows
        )
        place = (
            "the same position"
            if positioned
            else "no position (the output lacks `_file_idx` and `_source_line`)"
        )
        raise SinkError(
            f"sink {spec.name}: window {window_id}'s output `{spec.output}` has rows of one key "
            f"that differ with the same {spec.order_by} and {place}: {named}; nothing was "
            f"written. Keep `_file_idx` and `_source_line` in the output (the later record then "
            f"wins), or make {spec.order_by} tell the rows apart; then "
            f"`onceflow windows recompute {job} {window_id}` and run the job again."
        )


def restate_staged(
    conn: psycopg.Connection,
    spec: PostgresSink,
    staging: sql.Composable,
    job: str,
    window_id: int,
    positioned: bool = False,
) -> tuple[int, int]:
    """Replace the window's effect in the sink by the staged rows; return the rows written and
    the table's net change in rows."""
    if spec.mode == "accumulate":
        # Checked again under the commit's fence (maintenance drops contributions past the
        # detail horizon holding the same row): taking back nothing would count the window twice.
        if not has_contribution(conn, job, spec.name, window_id):
            raise SinkError(
                f"sink {spec.name}: window {window_id}'s contribution is no longer on record "
                f"({_dropped(conn, job, spec.name, window_id)}), so it cannot be taken back; "
                "nothing was written. Reconcile the sink instead."
            )
        new = sql.SQL("(SELECT {} FROM {} AS n)").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns), staging
        )
        old = contribution(spec, job, window_id)
        negated = sql.SQL("(SELECT {} FROM {} AS o)").format(
            sql.SQL(", ").join(
                [
                    *(sql.Identifier(k) for k in spec.key),
                    *(sql.SQL("-{}").format(sql.Identifier(a)) for a in spec.accumulate),
                    *(
                        sql.SQL("NULL::{}").format(sql.SQL(spec.columns[c]))
                        for c in spec.columns
                        if c not in spec.key and c not in spec.accumulate
                    ),
                ]
            ),
            old,
        )
        ordered = [*spec.key, *spec.accumulate]
        ordered += [c for c in spec.columns if c not in ordered]
        both = sql.SQL("(SELECT {} FROM {} AS n UNION ALL SELECT * FROM {} AS o)").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in ordered), new, negated
        )
        rows = accumulate(conn, spec, summed(spec, both))
        save_contribution(conn, spec, staging, job, window_id)
        return rows
    assert spec.window_column is not None  # checked by the group before any change
    where = sql.SQL("{} = {}").format(sql.Identifier(spec.window_column), sql.Literal(window_id))
    if spec.job_column is not None:
        where = sql.SQL("{} AND {} = {}").format(
            where, sql.Identifier(spec.job_column), sql.Literal(job)
        )
    deleted = conn.execute(
        sql.SQL("DELETE FROM {} WHERE {}").format(target_table(spec), where)
    ).rowcount
    rows, added = apply_staged(conn, spec, staging, job, window_id, positioned)
    return rows, added - deleted


def _dropped(conn: psycopg.Connection, job: str, sink: str, window_id: int) -> str:
    """Why a window's contribution is not on record, in a few words."""
    if detail_pruned_through(conn, job, sink) >= window_id:
        return "maintenance dropped it past the job's detail horizon"
    return "it was never recorded or was removed"
