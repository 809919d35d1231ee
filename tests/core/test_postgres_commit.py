"""onceflow.sinks.postgres.commit: the protocol tables and an accumulating sink's contributions."""

from __future__ import annotations

import psycopg
from psycopg import sql

from onceflow.sinks.postgres.commit import (
    PROTOCOL_DDL,
    _contribution,
    _save_contribution,
    has_contribution,
)
from onceflow.sinks.postgres.spec import PostgresSink

BALANCES = PostgresSink(
    name="balances",
    output="balances",
    table="balances",
    columns={"merchant_id": "text", "currency": "text", "total": "bigint", "n": "bigint"},
    key=("merchant_id", "currency"),
    mode="accumulate",
    accumulate=("total", "n"),
)
STAGING = sql.Identifier("onceflow", "stage_test")

# The table as versions before this one created it: a primary key on the jsonb key.
_OLD_CONTRIBUTIONS = """
CREATE SCHEMA IF NOT EXISTS onceflow;
CREATE TABLE onceflow.contributions (
    job text NOT NULL,
    sink text NOT NULL,
    window_id bigint NOT NULL,
    key jsonb NOT NULL,
    amounts jsonb NOT NULL,
    PRIMARY KEY (job, sink, window_id, key)
);
INSERT INTO onceflow.contributions VALUES ('j', 'balances', 1, '["m1", "EUR"]', '[5, 1]');
"""


def _indexes(conn: psycopg.Connection) -> dict[str, str]:
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes"
        " WHERE schemaname = 'onceflow' AND tablename = 'contributions'"
    ).fetchall()
    return {str(name): str(definition) for name, definition in rows}


def test_the_protocol_tables_are_created_and_an_old_contributions_key_is_dropped(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(_OLD_CONTRIBUTIONS)
        conn.commit()
        assert "contributions_pkey" in _indexes(conn)
        for _ in range(2):  # created again over itself: nothing changes
            conn.execute(PROTOCOL_DDL)
            conn.commit()
            assert set(_indexes(conn)) == {"contributions_window"}
            assert "(job, sink, window_id)" in _indexes(conn)["contributions_window"]
        rows = conn.execute("SELECT window_id, key, amounts FROM onceflow.contributions").fetchall()
    assert rows == [(1, ["m1", "EUR"], [5, 1])]


def _stage(conn: psycopg.Connection, rows: list[tuple[str, str, int, int]]) -> None:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(STAGING))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (merchant_id text, currency text, total numeric, n numeric)"
        ).format(STAGING)
    )
    with conn.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(STAGING)) as copy:
        for row in rows:
            copy.write_row(row)


def _read(conn: psycopg.Connection, window_id: int) -> list[tuple[object, ...]]:
    relation = _contribution(BALANCES, "j", window_id)
    return conn.execute(sql.SQL("SELECT * FROM {} AS c ORDER BY 1, 2").format(relation)).fetchall()


def test_a_window_contributes_one_row_per_key_and_saving_it_again_replaces_it(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(PROTOCOL_DDL)
        _stage(conn, [("m1", "EUR", 5, 1), ("m1", "EUR", 7, 1), ("m2", "USD", -3, 1)])
        _save_contribution(conn, BALANCES, STAGING, "j", 4)
        first = _read(conn, 4)
        assert first == [("m1", "EUR", 12, 2), ("m2", "USD", -3, 1)]
        # The same window saved again (a replay): its rows are replaced, not added.
        _save_contribution(conn, BALANCES, STAGING, "j", 4)
        assert _read(conn, 4) == first
        _stage(conn, [("m1", "EUR", 1, 1)])
        _save_contribution(conn, BALANCES, STAGING, "j", 5)
        assert _read(conn, 5) == [("m1", "EUR", 1, 1)]
        assert _read(conn, 4) == first
        assert has_contribution(conn, "j", "balances", 5)
        assert not has_contribution(conn, "j", "balances", 6)
