"""The dedupe key index: what it holds, its rebuild from the state sink, its lookups."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from psycopg import sql

from onceflow._keyindex import Basis, KeyIndex
from onceflow._keylookup import KEY_COL, LOOKUP_SETTINGS, SEEN_COL, key_strings, text_array
from onceflow.engine import build_engine
from onceflow.errors import SourceError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.ledger import Ledger
from onceflow.postgres import connect
from onceflow.settings import Settings
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact


def index_rows(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return dict(
            conn.execute(
                "SELECT key, window_id FROM onceflow.dedupe_keys WHERE job = 'payments'"
            ).fetchall()
        )


def delta_keys(lake: Path) -> dict[str, int]:
    table = DeltaTable(str(lake / "payments")).to_pyarrow_table(
        columns=["payment_id", "_window_id"]
    )
    return dict(zip(table["payment_id"].to_pylist(), table["_window_id"].to_pylist(), strict=True))


def new_index(dsn: str, job: str) -> KeyIndex:
    """The key index of `job`, its tables and the ledger's created."""
    ledger = Ledger(dsn, job)
    ledger.ensure_schema()
    index = KeyIndex(dsn, job, ledger)
    ledger.write("index", index.ensure_schema)
    return index


def test_the_index_holds_every_kept_key_with_its_window_and_survives_its_loss(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    engine = build_engine(PAYMENTS, settings, spark, pg_dsn)
    generate_payments(landing, records=900, files=3, duplicate_rate=0.2, invalid_rate=0.05, seed=4)
    engine.run(max_units_per_window=1)
    assert index_rows(pg_dsn) == delta_keys(lake)
    assert len(index_rows(pg_dsn)) > 0

    # The index lost (an older ledger, a restored database): the next window is still
    # deduplicated against every earlier one, its keys put back from the Delta state first.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM onceflow.dedupe_keys")
        conn.execute("DELETE FROM onceflow.dedupe_windows")
    # Same seed: the same payment ids again, with other fields; all duplicates.
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=4)
    result = engine.run(max_units_per_window=1)
    assert [w.window_id for w in result.windows] == [4, 5]
    assert sum(w.stats["duplicates"] for w in result.windows) > 0
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert index_rows(pg_dsn) == delta_keys(lake)
    with psycopg.connect(pg_dsn) as conn:
        indexed = [r[0] for r in conn.execute("SELECT window_id FROM onceflow.dedupe_windows")]
    assert sorted(indexed) == [1, 2, 3, 4, 5]


def test_a_lookup_sees_the_index_before_the_window_and_staged_keys(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    index = new_index(pg_dsn, "payments")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id) VALUES"
            " ('payments', 'a', 1), ('payments', 'b', 3), ('other', 'c', 1)"
        )
    staged = index.staging_writer("keys", 3, "test")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO onceflow."{staged.table}" ("{KEY_COL}", window_id) VALUES (%s, 3)',
            ("d",),
        )
    rows = spark.createDataFrame(
        [(k, None) for k in "abcde"] + [("a", "bad line")], "payment_id STRING, _reason STRING"
    )
    lookup = index.lookup(("payment_id",), 3, [staged.table])
    marked = {
        (r["payment_id"], r["_reason"]): r[SEEN_COL]
        for r in rows.mapInArrow(lookup, lookup.struct(rows.schema)).collect()
    }
    # a: window 1 < 3. b: window 3 itself (a replay of it), not before. c: another job's.
    # d: staged by window 3's predecessor. An invalid line is never an occurrence.
    assert marked == {
        ("a", None): True,
        ("b", None): False,
        ("c", None): False,
        ("d", None): True,
        ("e", None): False,
        ("a", "bad line"): False,
    }
    index.drop_staging(staged.table)


def _staged_keys(index: KeyIndex, dsn: str, window_id: int, keys: list[str]) -> str:
    table = index.staging_writer("keys", window_id, "test").table
    with psycopg.connect(dsn) as conn:
        statement = sql.SQL("COPY {} ({}, window_id) FROM STDIN").format(
            sql.Identifier("onceflow", table), sql.Identifier(KEY_COL)
        )
        with conn.cursor().copy(statement) as copy:
            for key in keys:
                copy.write_row((key, window_id))
    return table


def test_keys_enter_the_index_once_with_the_first_window_that_kept_them(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "payments")

    marks = itertools.count(1)

    def add(table: str, window_id: int, rows: int) -> bool:
        mark = next(marks)

        def work(conn: psycopg.Connection) -> bool:
            # Earlier work of the completing transaction, which a key already indexed must
            # not undo.
            conn.execute(
                "INSERT INTO onceflow.dedupe_windows (job, window_id, keys)"
                " VALUES ('marker', %s, %s)",
                (mark, window_id),
            )
            return index.add(conn, table, [window_id], rows)

        return index.ledger.write(f"index window {window_id}", work)

    assert add(_staged_keys(index, pg_dsn, 5, ["a", "b"]), 5, 2)
    assert index_rows(pg_dsn) == {"a": 5, "b": 5}
    # Window 3 indexed after window 5 (its lake lost and put back): a's first window is 3.
    assert add(_staged_keys(index, pg_dsn, 3, ["a", "c"]), 3, 2)
    assert index_rows(pg_dsn) == {"a": 3, "b": 5, "c": 3}
    # Window 5 indexed again (a replay): nothing changes.
    assert add(_staged_keys(index, pg_dsn, 5, ["a", "b"]), 5, 2)
    assert index_rows(pg_dsn) == {"a": 3, "b": 5, "c": 3}
    # Staged keys lost (a server restart empties an unlogged table): nothing moves.
    assert not add(_staged_keys(index, pg_dsn, 7, ["d"]), 7, 2)
    assert index_rows(pg_dsn) == {"a": 3, "b": 5, "c": 3}
    with psycopg.connect(pg_dsn) as conn:
        windows = conn.execute(
            "SELECT job, window_id, keys FROM onceflow.dedupe_windows ORDER BY 1, 2"
        ).fetchall()
    assert windows == [
        ("marker", 1, 5),
        ("marker", 2, 3),
        ("marker", 3, 5),
        ("marker", 4, 7),
        ("payments", 3, 2),
        ("payments", 5, 2),
    ]


def test_key_text_of_one_and_of_several_columns() -> None:
    import pyarrow as pa

    batch = pa.RecordBatch.from_pydict({"a": ["x", None, "z"], "b": [1, 2, None]})
    assert key_strings(batch, ["a"]).to_pylist() == ["x", None, "z"]
    assert key_strings(batch, ["b"]).to_pylist() == ["1", "2", None]
    assert key_strings(batch, ["a", "b"]).to_pylist() == ['["x", "1"]', None, None]


# Keys the array literal must quote or escape: its delimiters, quotes, backslashes, white
# space, the word NULL, the empty string, and several columns' keys (JSON arrays).
AWKWARD_KEYS = [
    'a"b',
    "back\\slash",
    "\\",
    '\\"',
    "x,y",
    "{z}",
    "",
    " padded ",
    "NULL",
    "null",
    "tab\there",
    "line\nbreak",
    "é ü 支付",
    '["m-1", "2"]',
]


def test_a_key_array_reaches_the_server_as_it_was(pg_dsn: str) -> None:
    import pyarrow as pa

    keys = pa.array([*AWKWARD_KEYS, *(f"pay-{i}" for i in range(1000))], pa.string())
    with psycopg.connect(pg_dsn) as conn:

        def back(values: pa.Array) -> list[str]:
            return conn.execute("SELECT %s::text[]", (text_array(values),)).fetchone()[0]

        assert back(keys) == keys.to_pylist()
        # A slice, as a lookup sends each chunk of a window's keys.
        assert back(keys.slice(3, 20)) == keys.to_pylist()[3:23]
        assert back(keys.slice(0, 0)) == []


def test_a_lookup_probes_the_index_at_any_history_size(pg_dsn: str) -> None:
    # At a million keys PostgreSQL's own estimate reads the whole table (in parallel) for a
    # window's 20,000 keys, a cost that grows with history; the lookup's sessions probe.
    index = new_index(pg_dsn, "big")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
            " SELECT 'big', 'h-' || g, 1 FROM generate_series(1, 1000000) AS g"
        )
        conn.execute("ANALYZE onceflow.dedupe_keys")
    keys = text_array(pa.array([f"n-{i}" for i in range(20_000)], pa.string()))
    [(query, params)] = index.lookup(("payment_id",), 2).queries()
    bound = tuple(keys if p is None else p for p in params)

    def plan(settings: dict[str, str] | None) -> str:
        with connect(pg_dsn, autocommit=True, settings=settings) as conn:
            rows = conn.execute(sql.SQL("EXPLAIN ") + query, bound).fetchall()
        return "\n".join(str(r[0]) for r in rows)

    assert "Seq Scan on dedupe_keys" in plan(None)  # what the planner would do on its own
    probed = plan(LOOKUP_SETTINGS)
    assert "dedupe_keys_pkey" in probed and "Seq Scan" not in probed


def test_a_lookup_marks_awkward_keys_exactly(spark: Any, pg_dsn: str) -> None:
    index = new_index(pg_dsn, "awkward")
    indexed = AWKWARD_KEYS[::2]
    with psycopg.connect(pg_dsn) as conn:
        with conn.cursor().copy(
            "COPY onceflow.dedupe_keys (job, key, window_id) FROM STDIN"
        ) as copy:
            for key in indexed:
                copy.write_row(("awkward", key, 1))
    rows = spark.createDataFrame([(k, None) for k in AWKWARD_KEYS], "k STRING, _reason STRING")
    lookup = index.lookup(("k",), 2, [])
    marked = {
        r["k"]: r[SEEN_COL] for r in rows.mapInArrow(lookup, lookup.struct(rows.schema)).collect()
    }
    assert marked == {k: k in indexed for k in AWKWARD_KEYS}


def test_a_partition_is_looked_up_batch_by_batch_one_batch_ahead(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "payments")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id)"
            " SELECT 'payments', 'k' || i, 1 FROM generate_series(0, 120, 3) AS i"
        )
    pulled: list[int] = []

    def parsed() -> Any:
        for n in range(5):
            pulled.append(n)
            ids = [f"k{i}" for i in range(n * 20, n * 20 + 25)]  # overlapping batches
            yield pa.RecordBatch.from_pydict(
                {"payment_id": ids, "_reason": [None] * 24 + ["bad line"], "n": [n] * 25}
            )

    lookup = index.lookup(("payment_id",), 2)
    marked = []
    for batch in lookup(parsed()):
        n = batch.column("n")[0].as_py()
        # The next batch was parsed (its lookup asked) before this one left; no more.
        assert pulled == list(range(min(n + 2, 5)))
        marked += zip(
            batch.column("payment_id").to_pylist(),
            batch.column("_reason").to_pylist(),
            batch.column(SEEN_COL).to_pylist(),
            strict=True,
        )
    assert len(marked) == 125
    for key, reason, seen in marked:
        assert seen == (reason is None and int(key[1:]) % 3 == 0), (key, reason)


def _in_order_marks(
    index: KeyIndex, columns: tuple[str, ...], batches: list[dict[str, list[Any]]]
) -> list[bool]:
    lookup = dataclasses.replace(index.lookup(columns, 2), in_order=True)
    marked: list[bool] = []
    for batch in lookup(pa.RecordBatch.from_pydict(b) for b in batches):
        marked += batch.column(SEEN_COL).to_pylist()
    return marked


def _first_occurrences(
    rows: list[tuple[Any, ...]], reasons: list[str | None], indexed: set[Any]
) -> list[bool]:
    """The oracle: a valid row is seen if the index had its key or an earlier valid row had
    it (keys compared as values); invalid rows and rows with a None in their key never are
    (the compute quarantines those)."""
    kept: set[Any] = set()
    seen = []
    for row, reason in zip(rows, reasons, strict=True):
        if reason is not None or None in row:
            seen.append(False)
        elif row in indexed or row in kept:
            seen.append(True)
        else:
            kept.add(row)
            seen.append(False)
    return seen


def test_an_in_order_lookup_also_marks_repeats_within_the_window(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "payments")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.dedupe_keys (job, key, window_id) VALUES ('payments', 'k3', 1)"
        )
    keys = ["k1", "k2", "k1", None, "k3", None, "k2", "k4", "k1", "k4", "k5", "k5", "k6", None]
    reasons = [None, "bad", None, None, None, None, None, "bad", None, None, None, None, "x", None]
    lines = list(range(1, len(keys) + 1))
    batches = [
        {"_file_idx": [0] * 5, "_source_line": lines[:5], "payment_id": keys[:5], "_reason": reasons[:5]},
        {"_file_idx": [0] * 4, "_source_line": lines[5:9], "payment_id": keys[5:9], "_reason": reasons[5:9]},
        {"_file_idx": [1] * 5, "_source_line": lines[9:], "payment_id": keys[9:], "_reason": reasons[9:]},
    ]  # fmt: skip
    marked = _in_order_marks(index, ("payment_id",), batches)
    assert marked == _first_occurrences([(k,) for k in keys], reasons, {("k3",)})
    # k2's first occurrence is invalid: its second is the first valid one, and is kept.
    assert marked[6] is False


def test_an_in_order_lookup_leaves_keys_with_a_null_part_alone(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "pairs")
    a = ["x", "x", None, None, "x", "y", None, "x"]
    b = [1, 1, 1, 1, None, 1, None, None]
    rows = list(zip(a, b, strict=True))
    batch = {"_file_idx": [0] * 8, "_source_line": list(range(1, 9)), "a": a, "b": b}
    marked = _in_order_marks(index, ("a", "b"), [batch])
    assert marked == _first_occurrences(rows, [None] * 8, set())
    assert marked == [False, True, False, False, False, False, False, False]


def test_an_in_order_lookup_fails_on_rows_out_of_order(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "payments")
    batches = [
        {"_file_idx": [1, 1], "_source_line": [1, 2], "payment_id": ["a", "b"]},
        {"_file_idx": [0], "_source_line": [9], "payment_id": ["a"]},
    ]
    with pytest.raises(SourceError, match="out of source order"):
        _in_order_marks(index, ("payment_id",), batches)


def test_an_in_order_lookup_compares_floating_keys_as_spark_does(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "floats")
    values = [-0.0, 0.0, float("nan"), float("nan"), None, None, 2.5]
    batch = {"_file_idx": [0] * 7, "_source_line": list(range(1, 8)), "v": values}
    marked = _in_order_marks(index, ("v",), [batch])
    assert marked == [False, True, False, True, False, False, False]


def test_the_index_state_names_every_window_a_dedupe_must_see(pg_dsn: str) -> None:
    index = new_index(pg_dsn, "payments")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, completed_at,"
            " skipped_at, skip_reason) VALUES"
            " ('payments', 1, '{}', 1, now(), NULL, NULL), ('payments', 2, '{}', 1, now(), NULL,"
            " NULL), ('payments', 3, '{}', 1, NULL, now(), 'gone'), ('payments', 4, '{}', 1,"
            " now(), NULL, NULL), ('payments', 5, '{}', 1, NULL, NULL, NULL)"
        )
        conn.execute(
            "INSERT INTO onceflow.dedupe_windows (job, window_id, keys) VALUES"
            " ('payments', 1, 1), ('payments', 2, 1), ('payments', 5, 1), ('other', 4, 1)"
        )
    state = index.state(6)
    # 3 skipped; 4 completed without its keys; 5 pending, yet indexed (a ledger changed).
    assert str(state.due) == "windows 1-2, 4-5"
    assert str(state.indexed) == "windows 1-2, 5"
    assert (state.missing, state.stale) == ([4], [5])
    assert state.settled == 4  # 1-3 are final: later looks read from window 4 on
    assert Basis.from_json(state.due.to_json()) == state.due
    assert state.indexed | [4] == state.due == Basis(((1, 2), (4, 5)))
    assert Basis(((1, 2),)) | [4] != state.due

    index.forget(state.stale)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("INSERT INTO onceflow.dedupe_windows VALUES ('payments', 4, 1)")
        conn.execute("UPDATE onceflow.windows SET completed_at = now() WHERE window_id = 5")
        conn.execute("INSERT INTO onceflow.dedupe_windows VALUES ('payments', 5, 1)")
        # Below the settled windows nothing is read again within a run.
        conn.execute("DELETE FROM onceflow.dedupe_windows WHERE window_id = 1")
    state = index.state(6)
    assert (state.missing, state.stale, state.settled) == ([], [], 6)
    assert state.indexed == state.due == Basis(((1, 2), (4, 5)))
    assert index.state(3).due == Basis(((1, 2),))
    index.reset()  # a new run looks at every window again
    assert index.state(6).missing == [1]


def test_a_runs_first_look_at_a_long_history_counts_what_it_can(pg_dsn: str) -> None:
    """Windows 1-60 completed and indexed but 7 and 30, skipped: the first look proves them
    settled by counts, and says what the look at every span would; a skipped window in the
    index, or a window the ledger lost, is found as before."""
    index = new_index(pg_dsn, "payments")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, completed_at,"
            " skipped_at, skip_reason) SELECT 'payments', i, '{}', 1,"
            " CASE WHEN i IN (7, 30) THEN NULL ELSE now() END,"
            " CASE WHEN i IN (7, 30) THEN now() END, CASE WHEN i IN (7, 30) THEN 'gone' END"
            " FROM generate_series(1, 60) AS i"
        )
        conn.execute(
            "INSERT INTO onceflow.dedupe_windows (job, window_id, keys) SELECT 'payments', i, 1"
            " FROM generate_series(1, 60) AS i WHERE i NOT IN (7, 30)"
        )
    state = index.state(61)
    assert state.settled == 61 and (state.missing, state.stale) == ([], [])
    assert state.due == state.indexed == Basis(((1, 6), (8, 29), (31, 60)))
    assert index.state(20).due == Basis(((1, 6), (8, 19)))

    with psycopg.connect(pg_dsn) as conn:  # skipped window 30's keys in the index: stale
        conn.execute("INSERT INTO onceflow.dedupe_windows VALUES ('payments', 30, 1)")
    index.reset()
    state = index.state(61)
    assert (state.settled, state.stale, state.missing) == (30, [30], [])
    with psycopg.connect(pg_dsn) as conn:  # and window 12's plan lost from the ledger
        conn.execute("DELETE FROM onceflow.dedupe_windows WHERE window_id = 30")
        conn.execute("DELETE FROM onceflow.windows WHERE window_id = 12")
    index.reset()
    state = index.state(61)
    assert state.settled == 12 and state.stale == [12]
