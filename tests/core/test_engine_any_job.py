"""The engine runs any job, not only the reference ones: a Parquet source, first-occurrence
dedupe on a Delta state sink, a PostgreSQL append and an accumulate sink committed in one
transaction, restatement and reconcile — each checked against plain Python."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import (
    ConfigurationError,
    Dedupe,
    DeltaSink,
    Engine,
    Job,
    ParquetSource,
    PostgresSink,
    Settings,
    WindowContext,
)
from onceflow.reconcile import reconcile
from onceflow.restate import restate_windows
from tests.support.latest_points import latest_points_job

SCHEMA = {"event_id": "string", "team": "string", "points": "bigint"}


def scores(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    events = rows.select(
        "event_id", "team", "points", F.lit(ctx.window_id).cast("bigint").alias("_window_id")
    )
    totals = events.groupBy("team").agg(
        F.sum("points").alias("points"), F.count(F.lit(1)).cast("bigint").alias("events")
    )
    return {"events": events, "totals": totals}


JOB = Job(
    name="scores",
    source=ParquetSource("scores", schema=SCHEMA),
    transform=scores,
    dedupe=Dedupe(key=("event_id",), state_sink="lake_events"),
    sinks=(
        DeltaSink("lake_events", "events", table="scores/events"),
        PostgresSink(
            "pg_events", "events", table="score_events",
            columns={"event_id": "text", "team": "text", "points": "bigint", "_window_id": "bigint"},
            window_column="_window_id",
        ),
        PostgresSink(
            "pg_team_totals", "totals", table="team_totals",
            columns={"team": "text", "points": "bigint", "events": "bigint"},
            key=("team",), mode="accumulate", accumulate=("points", "events"),
        ),
    ),
)  # fmt: skip


def _land(landing: Path, name: str, rows: list[tuple[str, str, int]]) -> None:
    folder = landing / "scores"
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "event_id": [r[0] for r in rows],
            "team": [r[1] for r in rows],
            "points": pa.array([r[2] for r in rows], pa.int64()),
        }
    )
    pq.write_table(table, folder / f".{name}.tmp")
    (folder / f".{name}.tmp").rename(folder / name)


def _expected(batches: list[list[tuple[str, str, int]]], double: set[int] = frozenset()):
    """First occurrence of each event id in landing order; points doubled in `double` windows
    (window = batch index + 1, one file per window)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for window, rows in enumerate(batches, start=1):
        for event_id, team, points in rows:
            if event_id not in seen:
                factor = 2 if window in double else 1
                seen[event_id] = (team, points * factor, window)
    totals: dict[str, tuple[int, int]] = {}
    for team, points, _ in seen.values():
        p, n = totals.get(team, (0, 0))
        totals[team] = (p + points, n + 1)
    return seen, totals


def _actual(dsn: str, lake: Path):
    with psycopg.connect(dsn) as conn:
        pg_rows = conn.execute(
            "SELECT event_id, team, points, _window_id FROM score_events"
        ).fetchall()
        totals = {t: (int(p), int(n)) for t, p, n in conn.execute("SELECT * FROM team_totals")}
    delta = DeltaTable(str(lake / "scores" / "events")).to_pyarrow_table().to_pylist()
    delta_rows = [(r["event_id"], r["team"], r["points"], r["_window_id"]) for r in delta]
    return pg_rows, delta_rows, totals


def _assert_exact(dsn: str, lake: Path, expected) -> None:
    seen, totals = expected
    want = Counter((e, t, p, w) for e, (t, p, w) in seen.items())
    pg_rows, delta_rows, got_totals = _actual(dsn, lake)
    for rows in (pg_rows, delta_rows):
        got = Counter(tuple(r) for r in rows)
        lost, doubled = want - got, got - want
        assert (sum(lost.values()), sum(doubled.values())) == (0, 0), (lost, doubled)
    assert got_totals == totals


def test_a_parquet_job_with_every_sink_mode(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    batches = [
        [("e1", "red", 3), ("e2", "blue", 5), ("e1", "red", 99)],  # e1 twice: the first wins
        [("e3", "red", 7), ("e2", "blue", 11)],  # e2 again, a window later: a duplicate
        [("e4", "green", 1)],
    ]
    for i, rows in enumerate(batches[:2]):
        _land(landing, f"b{i}.parquet", rows)
    engine = Engine(JOB, settings, spark, pg_dsn)
    first = engine.run(max_units_per_window=1)
    assert [w.window_id for w in first.windows] == [1, 2]
    assert first.windows[1].stats["duplicates"] == 1
    _assert_exact(pg_dsn, lake, _expected(batches[:2]))
    # The PostgreSQL sinks commit each window in one transaction: one xid for both.
    for window in first.windows:
        assert (
            window.sinks["pg_events"].commit_ref
            == window.sinks["pg_team_totals"].commit_ref
            is not None
        )

    _land(landing, "b2.parquet", batches[2])
    assert [w.window_id for w in engine.run().windows] == [3]
    assert engine.run().windows == []
    _assert_exact(pg_dsn, lake, _expected(batches))

    # Restate window 1 with doubled points: its events and its share of every total change.
    def doubled(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        return scores(rows.withColumn("points", F.col("points") * 2), ctx)

    changed = Engine(dataclasses.replace(JOB, transform=doubled), settings, spark, pg_dsn)
    restate_windows(changed, [1], request_id="double-1")
    _assert_exact(pg_dsn, lake, _expected(batches, double={1}))
    # Then the rest: the sinks now hold the new transform's result for every window, which is
    # what reconcile expects from the job as now defined.
    restate_windows(changed, [2, 3], request_id="double-rest")
    _assert_exact(pg_dsn, lake, _expected(batches, double={1, 2, 3}))

    # Damage from outside: a total and an event row; reconcile repairs exactly that.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE team_totals SET points = points + 1000 WHERE team = 'red'")
        conn.execute("DELETE FROM score_events WHERE event_id = 'e3'")
        conn.commit()
    report = reconcile(changed)
    counts = {s.sink: (s.missing, s.extra, s.changed) for s in report.sinks}
    assert counts["pg_events"] == (1, 0, 0) and counts["pg_team_totals"] == (0, 0, 1)
    assert counts["lake_events"] == (0, 0, 0)
    _assert_exact(pg_dsn, lake, _expected(batches, double={1, 2, 3}))
    assert reconcile(changed, dry_run=True).clean


def test_a_dedupe_state_without_window_ids_is_refused(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = dataclasses.replace(
        JOB,
        transform=lambda rows, ctx: {
            "events": rows.select("event_id", "team", "points"),
            "totals": scores(rows, ctx)["totals"],
        },
        sinks=(DeltaSink("lake_events", "events", table="scores/events"),),
    )
    _land(landing, "b0.parquet", [("e1", "red", 3)])
    _land(landing, "b1.parquet", [("e2", "red", 3)])
    with pytest.raises(ConfigurationError, match="_window_id"):
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)


def test_two_rows_for_one_upsert_key_in_a_window_is_a_clear_error(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    from onceflow import SinkError

    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = Job(
        name="latest_scores",
        source=ParquetSource("scores", schema=SCHEMA),
        transform=lambda rows, ctx: {"latest": rows.select("team", "points")},
        sinks=(
            PostgresSink(
                "pg_latest", "latest", table="latest_scores",
                columns={"team": "text", "points": "bigint"}, key=("team",), mode="upsert",
            ),
        ),
    )  # fmt: skip
    _land(landing, "b0.parquet", [("e1", "red", 3), ("e2", "red", 5)])
    with pytest.raises(SinkError, match="one row per key") as caught:
        Engine(job, settings, spark, pg_dsn).run()
    assert "red" not in str(caught.value)  # row values stay out of messages
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM latest_scores").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM onceflow.sink_commits").fetchone() == (0,)


def test_an_upsert_sink_inserts_windows_of_new_keys_and_upserts_once_a_key_returns(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, caplog
) -> None:
    """A window of keys the table lacks is inserted as it is; one that brings a key the table
    holds is committed again as an upsert, in one transaction either way (its rows' xmin is the
    window's commit ref), and the latest window's row of a key wins."""
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)

    job = latest_points_job(SCHEMA)
    batches = [
        [("e1", "red", 3), ("e2", "blue", 5)],
        [("e3", "green", 7)],  # new keys only
        [("e4", "red", 11), ("e5", "white", 13)],  # red returns
        [("e6", "blue", 17)],  # blue returns; the sink now upserts
    ]
    for i, rows in enumerate(batches):
        _land(landing, f"b{i}.parquet", rows)
    with caplog.at_level(logging.INFO, logger="onceflow.sinks.postgres.commit"):
        result = Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in result.windows] == [1, 2, 3, 4]
    # Windows 1 and 2 were inserted as they were; window 3 met red, and from then on the
    # sink upserts (window 4 is not tried as an insert first).
    switched = [r.getMessage() for r in caplog.records if "upserts from now on" in r.getMessage()]
    assert switched == [
        "window 3: sink pg_latest meets keys its table holds; it upserts from now on"
    ]
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT team, points, _window_id, xmin::text FROM latest_points ORDER BY team"
        ).fetchall()
    assert [r[:3] for r in rows] == [
        ("blue", 17, 4), ("green", 7, 2), ("red", 11, 3), ("white", 13, 3),
    ]  # fmt: skip
    refs = {w.window_id: w.sinks["pg_latest"].commit_ref for w in result.windows}
    assert {r[2]: r[3] for r in rows} == {w: refs[w] for w in (2, 3, 4)}
    assert {w.window_id: w.sinks["pg_latest"].rows for w in result.windows} == {
        1: 2, 2: 1, 3: 2, 4: 1,
    }  # fmt: skip
