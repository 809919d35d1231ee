"""The SQL of an accumulating sink: a window's sums added to (or, restated, taken back from) the
table's rows, and each window's contribution recorded so a restatement can take it back.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg import sql

from onceflow.sinks.postgres.spec import PostgresSink


def target_table(spec: PostgresSink) -> sql.Identifier:
    return sql.Identifier(spec.schema, spec.table)


def _keys_match(spec: PostgresSink, left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{}.{} = {}.{}").format(
            sql.Identifier(left), sql.Identifier(k), sql.Identifier(right), sql.Identifier(k)
        )
        for k in spec.key
    )


def summed(spec: PostgresSink, rows: sql.Composable) -> sql.Composable:
    """`rows` (a relation with the sink's columns) summed by key: one row per key.

    UPDATE … FROM uses only one of several matching rows, so an accumulating window must reach
    the table with each key once.
    """
    others = [c for c in spec.columns if c not in spec.key and c not in spec.accumulate]
    return sql.SQL("(SELECT {} FROM {} AS r GROUP BY {})").format(
        sql.SQL(", ").join(
            [
                *(sql.Identifier(k) for k in spec.key),
                *(
                    sql.SQL("sum({}::numeric) AS {}").format(sql.Identifier(c), sql.Identifier(c))
                    for c in spec.accumulate
                ),
                *(
                    sql.SQL("max({}) AS {}").format(sql.Identifier(c), sql.Identifier(c))
                    for c in others
                ),
            ]
        ),
        rows,
        sql.SQL(", ").join(sql.Identifier(k) for k in spec.key),
    )


def accumulate(
    conn: psycopg.Connection,
    spec: PostgresSink,
    delta: sql.Composable,
    *,
    record: tuple[str, int] | None = None,
) -> tuple[int, int]:
    """Add `delta` (one row per key, numeric amounts) into the table; drop rows back at zero.

    `record`: the (job, window id) whose contribution `delta` is, recorded in the same pass
    (the window's earlier record forgotten first, by the caller).

    Returns the rows written and the rows the table gained (inserted minus deleted)."""
    if key_is_unique(conn, spec):
        # A window's sum alone may be past the column's range while the total is not (amounts
        # of both signs): the upsert cannot add it in numeric, the two statements below can.
        conn.execute("SAVEPOINT onceflow_accumulate")
        try:
            done = _accumulate_upsert(conn, spec, delta, record)
        except psycopg.errors.NumericValueOutOfRange:
            conn.execute("ROLLBACK TO SAVEPOINT onceflow_accumulate")
        else:
            conn.execute("RELEASE SAVEPOINT onceflow_accumulate")
            return done
    if record is not None:
        conn.execute(_record_contribution(spec, *record, delta))
    target = target_table(spec)
    sets = [
        sql.SQL("{} = (t.{}::numeric + s.{})::{}").format(
            sql.Identifier(c), sql.Identifier(c), sql.Identifier(c), sql.SQL(spec.columns[c])
        )
        for c in spec.accumulate
    ]
    others = [c for c in spec.columns if c not in spec.key and c not in spec.accumulate]
    sets += [sql.SQL("{} = s.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in others]
    match = _keys_match(spec, "t", "s")
    conn.execute(
        sql.SQL("CREATE TEMP TABLE __delta ON COMMIT DROP AS SELECT * FROM {}").format(delta)
    )
    updated = conn.execute(
        sql.SQL("UPDATE {} AS t SET {} FROM __delta AS s WHERE {}").format(
            target, sql.SQL(", ").join(sets), match
        )
    ).rowcount
    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns)
    inserted = conn.execute(
        sql.SQL(
            "INSERT INTO {} ({}) SELECT {} FROM __delta AS s"
            " WHERE NOT EXISTS (SELECT 1 FROM {} AS t WHERE {})"
        ).format(target, col_list, _cast_columns(spec), target, match)
    ).rowcount
    deleted = _delete_emptied(conn, spec, sql.SQL("__delta"))
    conn.execute("DROP TABLE __delta")
    return updated + inserted, inserted - deleted


def _cast_columns(spec: PostgresSink) -> sql.Composable:
    """The columns of the relation `s` cast to the table's types, in table order."""
    return sql.SQL(", ").join(
        sql.SQL("s.{}::{}").format(sql.Identifier(c), sql.SQL(t)) for c, t in spec.columns.items()
    )


def _delete_emptied(conn: psycopg.Connection, spec: PostgresSink, delta: sql.Composable) -> int:
    """Delete the rows of `delta`'s keys whose accumulated columns all came back to zero."""
    # Such a row holds nothing (every payment of a day retracted): it goes, so the table equals
    # the sums over what is there.
    return conn.execute(
        sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {} AND {}").format(
            target_table(spec),
            delta,
            _keys_match(spec, "t", "s"),
            sql.SQL(" AND ").join(
                sql.SQL("t.{} = 0").format(sql.Identifier(c)) for c in spec.accumulate
            ),
        )
    ).rowcount


def key_is_unique(conn: psycopg.Connection, spec: PostgresSink) -> bool:
    """Whether the sink's table has a unique index on exactly its key that `ON CONFLICT` can
    use: valid, not partial, not on expressions, not deferred. Tables onceflow creates have one
    (their primary key); a table a user made may not."""
    row = conn.execute(
        """
        SELECT EXISTS (
            SELECT 1 FROM pg_index AS i
             WHERE i.indrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))
               AND i.indisunique AND i.indisvalid AND i.indimmediate
               AND i.indpred IS NULL AND i.indexprs IS NULL
               AND i.indnatts = cardinality(%s::text[])
               AND (SELECT array_agg(a.attname::text ORDER BY a.attname::text)
                      FROM pg_attribute AS a
                     WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey))
                   = (SELECT array_agg(k ORDER BY k) FROM unnest(%s::text[]) AS k))
        """,
        (spec.schema, spec.table, list(spec.key), list(spec.key)),
    ).fetchone()
    return bool(row and row[0])


def _accumulate_upsert(
    conn: psycopg.Connection,
    spec: PostgresSink,
    delta: sql.Composable,
    record: tuple[str, int] | None = None,
) -> tuple[int, int]:
    """`accumulate` in one pass over the key's unique index: one `INSERT … ON CONFLICT DO
    UPDATE` instead of a temporary table, an update and an insert of the keys not there; with
    `record`, the contribution is inserted by the same statement, from the same sums (the
    staged rows are grouped once).

    The window's sum enters as the column's type (the proposed row) before it is added, so a
    sum past the column's range fails here (NumericValueOutOfRange) even where the total would
    fit; `accumulate` then adds it the other way, in numeric."""
    target = target_table(spec)
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    sets = [
        sql.SQL("{} = (t.{}::numeric + EXCLUDED.{}::numeric)::{}").format(
            sql.Identifier(c), sql.Identifier(c), sql.Identifier(c), sql.SQL(spec.columns[c])
        )
        for c in spec.accumulate
    ]
    sets += [
        sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
        for c in spec.columns
        if c not in spec.key and c not in spec.accumulate
    ]
    zero = sql.SQL(" AND ").join(
        sql.SQL("{} = 0").format(sql.Identifier(c)) for c in spec.accumulate
    )
    # A data-modifying CTE runs whether or not the query reads it.
    recorded = (
        sql.SQL(", c AS ({})").format(_record_contribution(spec, *record, sql.SQL("s")))
        if record is not None
        else sql.SQL("")
    )
    row = conn.execute(
        sql.SQL(
            "WITH s AS MATERIALIZED {}{},"
            " w AS (INSERT INTO {} AS t ({}) SELECT {} FROM s ORDER BY {}"
            " ON CONFLICT ({}) DO UPDATE SET {}"
            " RETURNING (xmax = 0) AS inserted, ({}) AS emptied)"
            " SELECT count(*), count(*) FILTER (WHERE inserted),"
            " count(*) FILTER (WHERE emptied) FROM w"
        ).format(
            delta,
            recorded,
            target,
            sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns),
            _cast_columns(spec),
            sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(k)) for k in spec.key),
            keys,
            sql.SQL(", ").join(sets),
            zero,
        )
    ).fetchone()
    assert row is not None
    written, inserted, emptied = (int(v) for v in row)
    # Rare (every amount of a key retracted): the delta is read again to find its keys.
    deleted = _delete_emptied(conn, spec, delta) if emptied else 0
    return written, inserted - deleted


def array_rows(
    spec: PostgresSink, alias: str, *, typed_amounts: bool = False
) -> tuple[sql.Composable, sql.Composable]:
    """The rows of a record holding one array per key column (`keys`) and per accumulated
    column (`amounts`), as a window's contribution or a reconcile's kept state does: the
    select list (the key columns cast back to their types, the amounts as numeric or, with
    `typed_amounts`, as their columns' types) and the `unnest(...) AS u(...)` to read it from."""
    # Keys were stored as text that casts back exactly (`_key_text`).
    typed = [
        sql.SQL("{}::{} AS {}").format(
            sql.Identifier(f"k{i}"), sql.SQL(spec.columns[k]), sql.Identifier(k)
        )
        for i, k in enumerate(spec.key)
    ]
    typed += [
        sql.SQL("{}{} AS {}").format(
            sql.Identifier(f"a{i}"),
            sql.SQL("::" + spec.columns[a]) if typed_amounts else sql.SQL(""),
            sql.Identifier(a),
        )
        for i, a in enumerate(spec.accumulate)
    ]
    # `keys[c:c]` is column c's values in key order; unnest zips the columns back into rows.
    slices = [
        sql.SQL("{}.keys[{}:{}]").format(
            sql.Identifier(alias), sql.Literal(i + 1), sql.Literal(i + 1)
        )
        for i in range(len(spec.key))
    ]
    slices += [
        sql.SQL("{}.amounts[{}:{}]").format(
            sql.Identifier(alias), sql.Literal(i + 1), sql.Literal(i + 1)
        )
        for i in range(len(spec.accumulate))
    ]
    names = [sql.Identifier(f"k{i}") for i in range(len(spec.key))]
    names += [sql.Identifier(f"a{i}") for i in range(len(spec.accumulate))]
    unnest = sql.SQL("unnest({}) AS u({})").format(
        sql.SQL(", ").join(slices), sql.SQL(", ").join(names)
    )
    return sql.SQL(", ").join(typed), unnest


def contribution(spec: PostgresSink, job: str, window_id: int) -> sql.Composable:
    """The recorded contribution of a window to an accumulating sink, as a relation: the key
    columns (as the table's types) and the summed amounts (numeric), one row per key."""
    where = sql.SQL("c.job = {} AND c.sink = {} AND c.window_id = {}").format(
        sql.Literal(job), sql.Literal(spec.name), sql.Literal(window_id)
    )
    typed, unnest = array_rows(spec, "c")
    legacy = [
        sql.SQL("(c.key ->> {})::{} AS {}").format(
            sql.Literal(i), sql.SQL(spec.columns[k]), sql.Identifier(k)
        )
        for i, k in enumerate(spec.key)
    ]
    legacy += [
        sql.SQL("(c.amounts ->> {})::numeric AS {}").format(sql.Literal(i), sql.Identifier(a))
        for i, a in enumerate(spec.accumulate)
    ]
    return sql.SQL(
        "(SELECT {typed} FROM onceflow.window_contributions AS c, {unnest} WHERE {where}"
        " UNION ALL SELECT {legacy} FROM onceflow.contributions AS c WHERE {where})"
    ).format(
        typed=typed,
        unnest=unnest,
        where=where,
        legacy=sql.SQL(", ").join(legacy),
    )


def forget_contribution(
    conn: psycopg.Connection, spec: PostgresSink, job: str, window_id: int
) -> None:
    for table in ("window_contributions", "contributions"):
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE job = %s AND sink = %s AND window_id = %s").format(
                sql.Identifier("onceflow", table)
            ),
            (job, spec.name, window_id),
        )


def _key_text(spec: PostgresSink, column: str) -> sql.Composable:
    """A key column's value as text that casts back to it exactly: its JSON text, which no
    session setting (DateStyle, TimeZone) changes; a text column as it is."""
    if spec.columns[column].strip().lower() == "text":
        return sql.Identifier(column)
    return sql.SQL("to_jsonb({}) #>> '{{}}'").format(sql.Identifier(column))


def save_contribution(
    conn: psycopg.Connection, spec: PostgresSink, staging: sql.Composable, job: str, window_id: int
) -> None:
    """Record what the window adds to an accumulating sink, in the commit's own transaction.

    A window that adds nothing records no row (`has_contribution` then reads its marker)."""
    forget_contribution(conn, spec, job, window_id)
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
    grouped = sql.SQL("(SELECT {}, {} FROM {} AS r GROUP BY {})").format(
        keys,
        sql.SQL(", ").join(
            sql.SQL("sum({}::numeric) AS {}").format(sql.Identifier(a), sql.Identifier(a))
            for a in spec.accumulate
        ),
        staging,
        keys,
    )
    conn.execute(_record_contribution(spec, job, window_id, grouped))


def _record_contribution(
    spec: PostgresSink, job: str, window_id: int, sums: sql.Composable
) -> sql.Composable:
    """The insert of a window's contribution row from `sums` (a relation with one row per key:
    the key columns and the accumulated columns summed as numeric)."""
    return sql.SQL(
        "INSERT INTO onceflow.window_contributions (job, sink, window_id, keys, amounts)"
        " SELECT {}, {}, {}, ARRAY[{}], ARRAY[{}] FROM {} AS g HAVING count(*) > 0"
    ).format(
        sql.Literal(job),
        sql.Literal(spec.name),
        sql.Literal(window_id),
        sql.SQL(", ").join(sql.SQL("array_agg({})").format(_key_text(spec, k)) for k in spec.key),
        sql.SQL(", ").join(
            sql.SQL("array_agg({})").format(sql.Identifier(a)) for a in spec.accumulate
        ),
        sums,
    )


def has_contribution(conn: psycopg.Connection, job: str, sink: str, window_id: int) -> bool:
    """Whether the window's contribution to an accumulating sink is on record (and was not
    dropped by maintenance past the job's detail horizon: `onceflow.detail_pruned`)."""
    return (
        conn.execute(
            "SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM onceflow.detail_pruned"
            "  WHERE job = %(job)s AND sink = %(sink)s AND through >= %(w)s)"
            " AND EXISTS (SELECT 1 FROM onceflow.window_contributions"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s"
            " UNION ALL SELECT 1 FROM onceflow.contributions"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s"
            " UNION ALL SELECT 1 FROM onceflow.sink_commits"
            " WHERE job = %(job)s AND sink = %(sink)s AND window_id = %(w)s AND rows_written = 0)",
            {"job": job, "sink": sink, "w": window_id},
        ).fetchone()
        is not None
    )


def detail_pruned_through(conn: psycopg.Connection, job: str, sink: str) -> int:
    """The window through which maintenance dropped the sink's per-window detail (0: none)."""
    row = conn.execute(
        "SELECT through FROM onceflow.detail_pruned WHERE job = %s AND sink = %s", (job, sink)
    ).fetchone()
    return int(row[0]) if row else 0


def forget_contributions(
    conn: psycopg.Connection, job: str, sinks: Sequence[str], through: int
) -> int:
    """Drop the recorded contributions of windows through `through` (maintenance, past the
    detail horizon); return the rows dropped. The caller records the point in
    `onceflow.detail_pruned` in the same transaction, so no restatement reads them again."""
    dropped = 0
    for table in ("window_contributions", "contributions"):
        cur = conn.execute(
            sql.SQL("DELETE FROM {} WHERE job = %s AND sink = ANY(%s) AND window_id <= %s").format(
                sql.Identifier("onceflow", table)
            ),
            (job, list(sinks), through),
        )
        dropped += cur.rowcount
    return dropped
