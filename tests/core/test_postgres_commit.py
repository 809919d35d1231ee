"""onceflow.sinks.postgres.commit: the protocol tables and an accumulating sink's contributions."""

from __future__ import annotations

import dataclasses
import io

import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from psycopg import sql

from onceflow._pgcopy import CopyWriter, _utc_as_text
from onceflow.sinks.postgres._accumulate import (
    accumulate,
    contribution,
    has_contribution,
    key_is_unique,
    save_contribution,
    summed,
)
from onceflow.sinks.postgres._markers import create_protocol_tables
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
            create_protocol_tables(conn)
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


def _read(
    conn: psycopg.Connection, window_id: int, sink: str = BALANCES.name
) -> list[tuple[object, ...]]:
    relation = contribution(dataclasses.replace(BALANCES, name=sink), "j", window_id)
    return conn.execute(sql.SQL("SELECT * FROM {} AS c ORDER BY 1, 2").format(relation)).fetchall()


def test_a_window_contributes_one_row_per_key_and_saving_it_again_replaces_it(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        create_protocol_tables(conn)
        _stage(conn, [("m1", "EUR", 5, 1), ("m1", "EUR", 7, 1), ("m2", "USD", -3, 1)])
        save_contribution(conn, BALANCES, STAGING, "j", 4)
        first = _read(conn, 4)
        assert first == [("m1", "EUR", 12, 2), ("m2", "USD", -3, 1)]
        # The same window saved again (a replay): its rows are replaced, not added.
        save_contribution(conn, BALANCES, STAGING, "j", 4)
        assert _read(conn, 4) == first
        _stage(conn, [("m1", "EUR", 1, 1)])
        save_contribution(conn, BALANCES, STAGING, "j", 5)
        assert _read(conn, 5) == [("m1", "EUR", 1, 1)]
        assert _read(conn, 4) == first
        assert has_contribution(conn, "j", "balances", 5)
        assert not has_contribution(conn, "j", "balances", 6)
        # One row a window, whatever its number of keys.
        stored = conn.execute(
            "SELECT window_id, keys, amounts FROM onceflow.window_contributions ORDER BY 1"
        ).fetchall()
        assert [(w, *_by_first_key(k, a)) for w, k, a in stored] == [
            (4, [["m1", "m2"], ["EUR", "USD"]], [[12, -3], [2, 1]]),
            (5, [["m1"], ["EUR"]], [[1], [1]]),
        ]
        _stage(conn, [])  # a window that adds nothing records nothing
        save_contribution(conn, BALANCES, STAGING, "j", 6)
        assert _read(conn, 6) == []
        assert not has_contribution(conn, "j", "balances", 6)


def _by_first_key(keys: list[list[str]], amounts: list[list[int]]) -> tuple[list, list]:
    """The arrays with their keys in the order of the first key column (GROUP BY's order is
    the server's choice)."""
    order = sorted(range(len(keys[0])), key=lambda r: keys[0][r])
    return [[col[r] for r in order] for col in keys], [[col[r] for r in order] for col in amounts]


def test_contributions_of_earlier_versions_are_read_and_replaced(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(_OLD_CONTRIBUTIONS)
        create_protocol_tables(conn)
        conn.execute(
            "INSERT INTO onceflow.contributions VALUES ('j', 'balances', 1, '[\"m2\", \"USD\"]',"
            " '[-4, 2]')"
        )
        assert _read(conn, 1) == [("m1", "EUR", 5, 1), ("m2", "USD", -4, 2)]
        assert has_contribution(conn, "j", "balances", 1)
        _stage(conn, [("m3", "GBP", 8, 1)])
        save_contribution(conn, BALANCES, STAGING, "j", 1)  # a restatement records it anew
        assert _read(conn, 1) == [("m3", "GBP", 8, 1)]
        left = conn.execute("SELECT count(*) FROM onceflow.contributions").fetchone()
        assert left == (0,)
        conn.rollback()


def test_keys_of_every_type_read_back_as_they_were(pg_dsn: str) -> None:
    spec = PostgresSink(
        name="by_day",
        output="by_day",
        table="by_day",
        columns={
            "day": "date",
            "at": "timestamptz",
            "shop": "bigint",
            "label": "text",
            "total": "numeric",
        },
        key=("day", "at", "shop", "label"),
        mode="accumulate",
        accumulate=("total",),
    )
    row = ("2026-03-04", "2026-03-04T05:06:07.123456+05:30", -7, 'a "quoted", {odd} label', 10**30)
    with psycopg.connect(pg_dsn) as conn:
        create_protocol_tables(conn)
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(STAGING))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (day date, at timestamptz, shop bigint, label text, total numeric)"
            ).format(STAGING)
        )
        conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s, %s, %s)").format(STAGING), row)
        conn.execute("SET DateStyle = 'SQL, MDY'")
        conn.execute("SET TimeZone = 'America/Chicago'")
        save_contribution(conn, spec, STAGING, "j", 1)
        conn.execute("SET DateStyle = 'German'")
        conn.execute("SET TimeZone = 'Asia/Tokyo'")
        # Compared in the server, under the other settings: the keys are cast back there.
        relation = contribution(spec, "j", 1)
        differ = conn.execute(
            sql.SQL(
                "SELECT (SELECT count(*) FROM {rel} AS c),"
                " (SELECT count(*) FROM (SELECT * FROM {rel} AS c EXCEPT ALL"
                " SELECT * FROM {stage}) AS d),"
                " (SELECT count(*) FROM (SELECT * FROM {stage} EXCEPT ALL"
                " SELECT * FROM {rel} AS c) AS d)"
            ).format(rel=relation, stage=STAGING)
        ).fetchone()
        conn.rollback()
    assert differ == (1, 0, 0)


def _balances_table(conn: psycopg.Connection, table: str, extra: str) -> PostgresSink:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (merchant_id text NOT NULL, currency text NOT NULL,"
            " total bigint NOT NULL, n bigint NOT NULL{})"
        ).format(sql.Identifier(table), sql.SQL(extra))
    )
    return dataclasses.replace(BALANCES, table=table)


def test_the_key_is_unique_only_for_an_index_on_conflict_can_use(pg_dsn: str) -> None:
    cases = {
        ", PRIMARY KEY (currency, merchant_id)": True,  # the key's columns in another order
        ", UNIQUE (merchant_id, currency)": True,
        "": False,
        ", UNIQUE (merchant_id, currency, n)": False,
        ", UNIQUE (merchant_id)": False,
        ", UNIQUE (merchant_id, currency) DEFERRABLE INITIALLY DEFERRED": False,
    }
    with psycopg.connect(pg_dsn) as conn:
        for extra, unique in cases.items():
            spec = _balances_table(conn, "acc_target", extra)
            assert key_is_unique(conn, spec) is unique, extra
        spec = _balances_table(conn, "acc_target", "")
        conn.execute("CREATE UNIQUE INDEX ON acc_target (merchant_id, currency) WHERE n > 0")
        assert not key_is_unique(conn, spec)  # partial: ON CONFLICT cannot infer it
        conn.rollback()


def test_accumulating_gives_the_same_table_with_or_without_a_unique_key(pg_dsn: str) -> None:
    windows = [
        [("m1", "EUR", 5, 1), ("m1", "EUR", 7, 1), ("m2", "USD", -3, 1)],
        [("m1", "EUR", 2, 1), ("m3", "GBP", 4, 1), ("m3", "GBP", -4, -1)],  # m3 nets to zero
        [("m2", "USD", 3, -1), ("m1", "EUR", -14, -3), ("m4", "EUR", 9, 1)],  # m1, m2 emptied
        [("m5", "EUR", -(9 * 10**18), 1)],
        # Past bigint's range as one window's sum, not as a total: added in numeric.
        [("m5", "EUR", 9 * 10**18, 1), ("m5", "EUR", 9 * 10**18, 1)],
    ]
    outcomes: dict[str, list[tuple[int, int]]] = {}
    tables: dict[str, list[tuple[object, ...]]] = {}
    recorded: dict[str, list[list[tuple[object, ...]]]] = {}
    with psycopg.connect(pg_dsn) as conn:
        create_protocol_tables(conn)
        for extra in (", PRIMARY KEY (merchant_id, currency)", ""):
            spec = _balances_table(conn, "acc_target", extra)
            results = []
            for window_id, rows in enumerate(windows):
                _stage(conn, rows)
                # Each window's contribution is recorded by the same pass (once: the window
                # past the column's range takes the second path after the first rolled back).
                results.append(
                    accumulate(conn, spec, summed(spec, STAGING), record=("j", window_id))
                )
            outcomes[extra] = results
            tables[extra] = conn.execute("SELECT * FROM acc_target ORDER BY 1, 2").fetchall()
            recorded[extra] = [_read(conn, w, spec.name) for w in range(len(windows))]
            conn.execute("DELETE FROM onceflow.window_contributions")
        conn.rollback()
    with_key, without = outcomes.values()
    # (rows written, the table's net change in rows), window by window.
    assert with_key == without == [(2, 2), (2, 0), (3, -1), (1, 1), (1, 0)]
    expected = [("m4", "EUR", 9, 1), ("m5", "EUR", 9 * 10**18, 3)]
    assert tables[", PRIMARY KEY (merchant_id, currency)"] == tables[""] == expected
    sums = [
        [("m1", "EUR", 12, 2), ("m2", "USD", -3, 1)],
        [("m1", "EUR", 2, 1), ("m3", "GBP", 0, 0)],
        [("m1", "EUR", -14, -3), ("m2", "USD", 3, -1), ("m4", "EUR", 9, 1)],
        [("m5", "EUR", -(9 * 10**18), 1)],
        [("m5", "EUR", 18 * 10**18, 2)],
    ]
    assert recorded[", PRIMARY KEY (merchant_id, currency)"] == recorded[""] == sums


def _csv(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    pacsv.write_csv(table, buffer, options)
    return buffer.getvalue()


# Seconds since the epoch: before it, on it, a leap day, and the ends of PostgreSQL's range
# that every unit can hold.
_MOMENTS = [-62135596800, -86400 * 365 * 70 - 1, -1, 0, 1, 951868799, 1709251199, 4102444800]


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_utc_timestamps_reach_postgresql_as_the_csv_writer_would_print_them(
    pg_dsn: str, unit: str
) -> None:
    per_second = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}[unit]
    moments = [m for m in _MOMENTS if unit != "ns" or abs(m) < 9 * 10**9]
    values = [m * per_second + (7 * per_second // 9) for m in moments] + [None]
    at = pa.array(values, pa.timestamp(unit, tz="UTC"))
    # One column three times, into a timestamptz, a timestamp and a text column.
    table = pa.table({"at": at, "wall": at, "txt": at, "n": range(len(values))})

    texted = _utc_as_text(table)

    assert {texted.schema.field(c).type for c in ("at", "wall", "txt")} == {pa.string()}
    # The same text, quoted as strings are.
    assert _csv(texted).replace(b'"', b"") == _csv(table)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SET TimeZone = 'Asia/Tokyo'")  # the text carries its own zone
        for name in ("writer", "texted"):
            conn.execute(
                sql.SQL(
                    "CREATE TEMPORARY TABLE {} (at timestamptz, wall timestamp, txt text, n int)"
                ).format(sql.Identifier(name))
            )
        for name, data in (("writer", _csv(table)), ("texted", _csv(texted))):
            statement = sql.SQL("COPY {} FROM STDIN (FORMAT csv)").format(sql.Identifier(name))
            with conn.cursor().copy(statement) as copy:
                copy.write(data)
        writer = conn.execute("SELECT * FROM writer ORDER BY n").fetchall()
        texted_rows = conn.execute("SELECT * FROM texted ORDER BY n").fetchall()
    assert len(writer) == len(values)
    assert texted_rows == writer
    assert writer[-1][:3] == (None, None, None)


@pytest.mark.parametrize("zone", ["Etc/UTC", "Asia/Kolkata"])
def test_timestamps_of_another_zone_are_left_to_the_csv_writer(zone: str) -> None:
    table = pa.table({"at": pa.array([0, None], pa.timestamp("us", tz=zone))})
    assert _utc_as_text(table) == table


def _copy_sessions(conn: psycopg.Connection, app: str) -> set[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)
    ).fetchall()
    return {int(r[0]) for r in rows}


def test_a_workers_copies_reuse_its_idle_session_and_a_lost_one_is_replaced(
    pg_dsn: str,
) -> None:
    app = "onceflow/copy-test/e1"
    batch = pa.record_batch({"n": pa.array(range(50), pa.int64()), "t": ["x"] * 50})
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA IF NOT EXISTS onceflow")
        for table in ("copy_1", "copy_2", "copy_3"):
            admin.execute(
                sql.SQL("CREATE TABLE {} (n bigint, t text)").format(
                    sql.Identifier("onceflow", table)
                )
            )

        def copy(table: str) -> None:
            handle = CopyWriter(table, "out", pg_dsn, app, table, ["n", "t"], 5.0).open(0)
            handle.write(batch)
            assert handle.close() == {"rows": 50}

        copy("copy_1")
        kept = _copy_sessions(admin, app)
        assert len(kept) == 1  # left open and idle for the next window's COPY
        copy("copy_2")
        assert _copy_sessions(admin, app) == kept  # no new backend
        admin.execute("SELECT pg_terminate_backend(%s)", (next(iter(kept)),))
        copy("copy_3")  # the kept session is gone: the COPY is sent again on a new one
        assert _copy_sessions(admin, app).isdisjoint(kept)
        for table in ("copy_1", "copy_2", "copy_3"):
            count = admin.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("onceflow", table))
            ).fetchone()
            assert count == (50,)


LATEST = PostgresSink(
    name="latest",
    output="latest",
    table="latest_fresh",
    columns={"team": "text", "points": "bigint"},
    key=("team",),
    mode="upsert",
)
LATEST_STAGING = sql.Identifier("onceflow", "stage_latest")


def _stage_latest(conn: psycopg.Connection, rows: list[tuple[str, int]]) -> None:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(LATEST_STAGING))
    conn.execute(sql.SQL("CREATE TABLE {} (team text, points bigint)").format(LATEST_STAGING))
    with conn.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(LATEST_STAGING)) as copy:
        for row in rows:
            copy.write_row(row)


@pytest.mark.parametrize(
    ("table_key", "window", "refused"),
    [
        ("PRIMARY KEY", [("blue", 2)], None),
        ("PRIMARY KEY", [("red", 2)], psycopg.errors.UniqueViolation),  # a taken key
        ("PRIMARY KEY", [("blue", 2), ("blue", 3)], psycopg.errors.UniqueViolation),  # twice
        ("", [("blue", 2)], psycopg.errors.InvalidColumnReference),  # no unique index
    ],
)
def test_a_fresh_insert_takes_only_new_keys_into_a_table_keyed_on_them(
    pg_dsn: str,
    table_key: str,
    window: list[tuple[str, int]],
    refused: type[Exception] | None,
) -> None:
    """An upsert sink's window inserted as it is (`fresh`) refuses whatever an upsert would
    have to decide: a key the table holds, two rows of one key, and a table with no unique
    index on the key (which would otherwise take a second row of a key without a word)."""
    from onceflow.sinks.postgres._apply import apply_staged

    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS onceflow")
        conn.execute("DROP TABLE IF EXISTS latest_fresh")
        conn.execute(f"CREATE TABLE latest_fresh (team text {table_key}, points bigint)")
        conn.execute("INSERT INTO latest_fresh VALUES ('red', 1)")
        _stage_latest(conn, window)
        conn.commit()
        if refused is None:
            assert apply_staged(conn, LATEST, LATEST_STAGING, "j", 2, fresh=True) == (1, 1)
            conn.commit()
        else:
            with pytest.raises(refused):
                apply_staged(conn, LATEST, LATEST_STAGING, "j", 2, fresh=True)
            conn.rollback()
        held = conn.execute("SELECT team, points FROM latest_fresh ORDER BY team").fetchall()
    assert held == ([("blue", 2), ("red", 1)] if refused is None else [("red", 1)])
