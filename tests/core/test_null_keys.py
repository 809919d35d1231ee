"""A user job whose dedupe key is sometimes null: one rule for run, replay, restatement,
reconcile and the quality suites. Such a record has no key, so it is quarantined, every one,
in every window; a value that merely reads like a null ("None", "null", "") is a key as any
other."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from onceflow import Dedupe, DeltaSink, Job, ParquetSource, PostgresSink, quarantine_table
from onceflow.engine import build_engine
from onceflow.reconcile import reconcile
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from onceflow.validation import validate_job

JOB = "null_keyed"
FOLDER = "events"
KEY = ("region", "id")

Record = tuple[str | None, str | None, int]  # region, id, amount

# One file per window (files enter in name order). Null key parts, repeated within a window
# and across windows, next to values that read like a null.
FILES: dict[str, list[Record]] = {
    "e-001.parquet": [
        ("eu", "a", 1),
        (None, "a", 2),
        (None, "a", 3),  # the same null key again in the window: quarantined too
        ("eu", None, 4),
        (None, None, 5),
        ("None", "a", 6),  # reads like a null: a key
        ("eu", "a", 7),  # duplicate
        ("", "b", 8),
    ],
    "e-002.parquet": [
        (None, "a", 9),  # the null key of window 1 again: quarantined, not a duplicate
        ("None", "a", 10),  # duplicate of window 1's "None"
        ("null", "a", 11),
        (None, "b", 12),  # not the "" of window 1
        ("", "b", 13),  # duplicate
        ("eu", None, 14),
        ("us", "c", 15),
    ],
    "e-003.parquet": [
        ("eu", None, 16),
        ("null", "a", 17),  # duplicate of window 2's "null"
        (None, "None", 18),
        ("None", "None", 19),
        (None, None, 20),
        ("us", "c", 21),  # duplicate
        ("us", "d", 22),
    ],
}

EVENT_COLUMNS = {
    "region": "text",
    "id": "text",
    "amount": "bigint",
    "_window_id": "bigint",
    "_source_file": "text",
    "_source_line": "bigint",
}
Event = tuple[Any, ...]  # EVENT_COLUMNS' values


def _events(rows: Any, ctx: Any) -> dict[str, Any]:
    return {
        "events": rows.select(
            "region",
            "id",
            "amount",
            ctx.window_id_column().alias("_window_id"),
            "_source_file",
            "_source_line",
        )
    }


NULL_KEYED = Job(
    name=JOB,
    source=ParquetSource(FOLDER, {"region": "string", "id": "string", "amount": "bigint"}),
    transform=_events,
    dedupe=Dedupe(key=KEY, state_sink="lake_events"),
    sinks=(
        DeltaSink("lake_events", "events", table="events"),
        PostgresSink(
            "pg_events",
            "events",
            table="events",
            columns=EVENT_COLUMNS,
            window_column="_window_id",
        ),
        quarantine_table("null_keyed_quarantine"),
    ),
    quarantine_sink="null_keyed_quarantine",
    deterministic=True,
)


def _write(landing: Path) -> None:
    folder = landing / FOLDER
    folder.mkdir(parents=True)
    for name, records in FILES.items():
        region, ids, amounts = (list(c) for c in zip(*records, strict=True))
        table = pa.table(
            {"region": region, "id": ids, "amount": amounts},
            pa.schema([("region", pa.string()), ("id", pa.string()), ("amount", pa.int64())]),
        )
        pq.write_table(table, folder / f".{name}.tmp")
        (folder / f".{name}.tmp").rename(folder / name)


def _oracle() -> tuple[list[Event], list[tuple[int, str, int, str, dict[str, Any]]]]:
    """The kept events and the quarantine rows (window, file, line, reason, record) the
    files give: a record with a null key part is quarantined, else the first of its key is
    kept."""
    kept: list[Event] = []
    quarantined = []
    seen: set[tuple[str, str]] = set()
    for window_id, (name, records) in enumerate(sorted(FILES.items()), start=1):
        source = f"{FOLDER}/{name}"
        for line, (region, id_, amount) in enumerate(records, start=1):
            if region is None or id_ is None:
                column = "region" if region is None else "id"
                record = {"region": region, "id": id_, "amount": amount}
                quarantined.append(
                    (window_id, source, line, f"dedupe key column {column} is null", record)
                )
            elif (region, id_) not in seen:
                seen.add((region, id_))
                kept.append((region, id_, amount, window_id, source, line))
    return sorted(kept, key=repr), sorted(quarantined, key=repr)


def _delta_events(lake: Path) -> list[Event]:
    table = DeltaTable(str(lake / "events")).to_pyarrow_table(columns=list(EVENT_COLUMNS))
    columns = [table.column(c).to_pylist() for c in EVENT_COLUMNS]
    return sorted(zip(*columns, strict=True), key=repr)


def _pg_state(dsn: str) -> dict[str, list[Any]]:
    """The PostgreSQL sinks' rows, each with the transaction that wrote it (`xmin`)."""
    names = ", ".join(EVENT_COLUMNS)
    with psycopg.connect(dsn) as conn:
        events = conn.execute(f"SELECT xmin::text, {names} FROM public.events").fetchall()
        quarantine = conn.execute(
            "SELECT xmin::text, window_id, source_file, source_line, reason, raw_line"
            " FROM onceflow.quarantine WHERE job = %s",
            (JOB,),
        ).fetchall()
    return {"events": sorted(events, key=repr), "quarantine": sorted(quarantine, key=repr)}


def _lost_and_doubled(actual: list[Any], expected: list[Any]) -> tuple[int, int]:
    have, want = Counter(map(repr, actual)), Counter(map(repr, expected))
    return sum((want - have).values()), sum((have - want).values())


def _assert_exact(dsn: str, lake: Path) -> None:
    kept, quarantined = _oracle()
    state = _pg_state(dsn)
    pg_events = [tuple(r[1:]) for r in state["events"]]
    for name, actual in (("lake_events", _delta_events(lake)), ("pg_events", pg_events)):
        assert _lost_and_doubled(actual, kept) == (0, 0), (name, actual, kept)
    rows = [(w, f, n, reason, json.loads(raw)) for _, w, f, n, reason, raw in state["quarantine"]]
    assert _lost_and_doubled(rows, quarantined) == (0, 0), (rows, quarantined)


def test_null_dedupe_keys_follow_one_rule_through_run_reconcile_validate_and_restate(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    engine = build_engine(NULL_KEYED, settings, spark, pg_dsn)
    _write(landing)
    kept, quarantined = _oracle()
    assert (len(kept), len(quarantined)) == (7, 10)

    ran = engine.run(max_units_per_window=1)
    assert [w.window_id for w in ran.windows] == [1, 2, 3]
    _assert_exact(pg_dsn, lake)

    # Reconcile's expected state is computed over all three windows at once: the same rule.
    dry = reconcile(engine, dry_run=True)
    assert dry.clean, dry
    assert {d.sink: (d.missing, d.extra, d.changed) for d in dry.sinks} == {
        "lake_events": (0, 0, 0),
        "pg_events": (0, 0, 0),
        "null_keyed_quarantine": (0, 0, 0),
    }
    before = _pg_state(pg_dsn)
    repaired = reconcile(engine)
    assert repaired.clean and not any(d.repaired for d in repaired.sinks), repaired
    assert _pg_state(pg_dsn) == before  # not a row rewritten
    _assert_exact(pg_dsn, lake)

    report = validate_job(engine)
    assert report.passed, [(r.sink, r.check, r.observed) for r in report.failures()]
    checked = {(r.sink, r.check) for r in report.results}
    assert {("lake_events", "keys_unique"), ("lake_events", "not_null:region")} <= checked

    # A restated window is computed alone, against the key index: the same rows again.
    restated = restate_windows(engine, [2], request_id="null-keys")
    assert [r.window_id for r in restated] == [2]
    _assert_exact(pg_dsn, lake)
    assert reconcile(engine, dry_run=True).clean


@pytest.mark.parametrize("text", ["None", "null", "NULL", "", "[null]", '["eu", null]'])
def test_no_key_text_is_taken_for_a_null(text: str) -> None:
    from onceflow._keylookup import key_strings

    one = pa.RecordBatch.from_pydict({"k": [text, None]})
    assert key_strings(one, ["k"]).to_pylist() == [text, None]
    two = pa.RecordBatch.from_pydict({"a": [text, None, text], "b": ["x", "x", None]})
    assert key_strings(two, ["a", "b"]).to_pylist() == [json.dumps([text, "x"]), None, None]
