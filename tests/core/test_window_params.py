"""A run plans a deterministic job's windows once per slot, and each window's tasks still
compute that window: its files, its id, its dedupe against every window before it. A transform
whose plan would not hold for another window (it reads `ctx.window_id` while planning, rows
from outside its window, or runs Spark jobs while planning) is planned window by window; one
whose physical plan keeps results of its first execution (a shuffle, a broadcast) is planned
again by Spark for each window. Checked against plain Python on real Spark, PostgreSQL and
Delta."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import (
    ArrowParse,
    Dedupe,
    DeltaSink,
    Engine,
    Job,
    LandingSource,
    PostgresSink,
    Settings,
    WindowContext,
)
from onceflow.errors import ConfigurationError
from onceflow.sinks.writers import WritersPlan
from onceflow.window import prepare as prepare_module

PARSED = (
    "_file_idx INT, _source_file STRING, _source_line BIGINT, event_id STRING, team STRING, "
    "points BIGINT, _reason STRING, _raw_text STRING"
)


def _parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`event_id,team,points` lines; anything else is invalid, with its reason."""
    for batch in batches:
        columns: dict[str, list] = {
            name: [] for name in ("event_id", "team", "points", "_reason", "_raw_text")
        }
        for raw in batch.column("_raw").to_pylist():
            text = raw.decode("utf-8", "replace")
            parts = text.split(",")
            valid = len(parts) == 3 and parts[2].lstrip("-").isdigit()
            columns["event_id"].append(parts[0] if valid else None)
            columns["team"].append(parts[1] if valid else None)
            columns["points"].append(int(parts[2]) if valid else None)
            columns["_reason"].append(None if valid else "not event_id,team,points")
            columns["_raw_text"].append(text)
        yield pa.RecordBatch.from_pydict(
            {
                "_file_idx": batch.column("_file_idx"),
                "_source_file": batch.column("_source_file"),
                "_source_line": batch.column("_source_line"),
                "event_id": pa.array(columns["event_id"], pa.string()),
                "team": pa.array(columns["team"], pa.string()),
                "points": pa.array(columns["points"], pa.int64()),
                "_reason": pa.array(columns["_reason"], pa.string()),
                "_raw_text": pa.array(columns["_raw_text"], pa.string()),
            }
        )


class Planning:
    """Transforms that count how often the engine plans them."""

    def __init__(self) -> None:
        self.calls = 0

    def by_column(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        self.calls += 1
        return _outputs(rows.withColumn("_window_id", ctx.window_id_column()))

    def by_literal(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        self.calls += 1
        return _outputs(rows.withColumn("_window_id", F.lit(ctx.window_id).cast("bigint")))

    def by_udf(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        """The context travels to the executors in a UDF and is read there."""
        self.calls += 1
        window_of = F.udf(lambda _: ctx.window_id, "bigint")
        return _outputs(rows.withColumn("_window_id", window_of(F.col("event_id"))))

    def with_own_aggregate(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        """Joins the rows with an aggregate of themselves (a join Spark broadcasts)."""
        self.calls += 1
        top = rows.groupBy("team").agg(F.max("points").alias("top"))
        joined = rows.join(top, "team").where("points <= top").drop("top")
        return _outputs(joined.withColumn("_window_id", ctx.window_id_column()))

    def with_eager_count(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        """Counts its rows while planning (a Spark job of its own, run there and then)."""
        self.calls += 1
        events = rows.withColumn("_window_id", ctx.window_id_column())
        return _outputs(events.where(F.lit(rows.count()) >= 0))

    def repartitioned(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        """Spreads the rows over partitions (a shuffle)."""
        self.calls += 1
        spread = rows.repartition(3, "event_id")
        return _outputs(spread.withColumn("_window_id", ctx.window_id_column()))

    def with_outside_rows(self, rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
        """Joins rows that are not the window's (a team table made while planning)."""
        self.calls += 1
        teams = rows.sparkSession.createDataFrame([("red", 1), ("blue", 1)], "team STRING, w INT")
        joined = rows.join(F.broadcast(teams), "team", "left").drop("w")
        return _outputs(joined.withColumn("_window_id", ctx.window_id_column()))


def _outputs(events: DataFrame) -> Mapping[str, DataFrame]:
    events = events.select("event_id", "team", "points", "_window_id")
    totals = events.groupBy("team").agg(
        F.sum("points").alias("points"), F.count(F.lit(1)).cast("bigint").alias("events")
    )
    return {"events": events, "totals": totals}


def _job(transform, name: str, parse=_parse) -> Job:
    return Job(
        name=name,
        source=LandingSource(folder=name, suffix=".txt"),
        parse=ArrowParse(parse, PARSED, keeps_order=True),
        transform=transform,
        deterministic=True,
        dedupe=Dedupe(key=("event_id",), state_sink="lake_events"),
        sinks=(
            DeltaSink("lake_events", "events", table=f"{name}/events"),
            PostgresSink(
                "pg_events", "events", table=f"{name}_events",
                columns={"event_id": "text", "team": "text", "points": "bigint",
                         "_window_id": "bigint"},
                window_column="_window_id",
            ),
            PostgresSink(
                "pg_totals", "totals", table=f"{name}_totals",
                columns={"team": "text", "points": "bigint", "events": "bigint"},
                key=("team",), mode="accumulate", accumulate=("points", "events"),
            ),
        ),
    )  # fmt: skip


# One file a window. Repeats within a window and across windows of both slots (2 → 3 is the
# other slot, 1 → 3 and 2 → 6 the same one), and invalid lines.
WINDOWS = [
    ["e1,red,3", "e2,blue,5", "e1,red,99", "bad line"],
    ["e3,red,7", "e4,blue,1"],
    ["e3,red,70", "e1,red,1", "e5,green,2"],
    ["e6,blue,4", "e6,blue,40"],
    ["7,,"],
    ["e4,blue,9", "e7,red,8"],
]


def _land(landing: Path, name: str) -> None:
    folder = landing / name
    folder.mkdir(parents=True)
    for i, lines in enumerate(WINDOWS):
        (folder / f"f{i}.txt").write_text("\n".join(lines) + "\n")


def _expected() -> tuple[Counter, dict[str, tuple[int, int]]]:
    seen: dict[str, tuple[str, int, int]] = {}
    for window, lines in enumerate(WINDOWS, start=1):
        for line in lines:
            parts = line.split(",")
            if len(parts) == 3 and parts[2].isdigit() and parts[0] not in seen:
                seen[parts[0]] = (parts[1], int(parts[2]), window)
    totals: dict[str, tuple[int, int]] = {}
    for team, points, _ in seen.values():
        p, n = totals.get(team, (0, 0))
        totals[team] = (p + points, n + 1)
    return Counter((e, t, p, w) for e, (t, p, w) in seen.items()), totals


def _run(
    spark,
    pg_dsn: str,
    tmp_path: Path,
    lake: Path,
    landing: Path,
    transform,
    name: str,
    parse=_parse,
):
    _land(landing, name)
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = _job(transform, name, parse)
    result = Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in result.windows] == list(range(1, len(WINDOWS) + 1))
    assert [w.stats["rows_in"] - w.stats["valid"] for w in result.windows] == [1, 0, 0, 0, 1, 0]
    assert [w.stats["duplicates"] for w in result.windows] == [1, 0, 2, 1, 0, 1]
    want, totals = _expected()
    with psycopg.connect(pg_dsn) as conn:
        pg_rows = conn.execute(
            f"SELECT event_id, team, points, _window_id FROM {name}_events"
        ).fetchall()
        got_totals = {
            t: (int(p), int(n)) for t, p, n in conn.execute(f"SELECT * FROM {name}_totals")
        }
    delta = DeltaTable(str(lake / name / "events")).to_pyarrow_table().to_pylist()
    delta_rows = [(r["event_id"], r["team"], r["points"], r["_window_id"]) for r in delta]
    for rows in (pg_rows, delta_rows):
        got = Counter(tuple(r) for r in rows)
        lost, doubled = want - got, got - want
        assert (sum(lost.values()), sum(doubled.values())) == (0, 0), (lost, doubled)
    assert got_totals == totals


def test_a_run_plans_once_per_slot_and_each_window_computes_its_own_rows(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, monkeypatch
) -> None:
    planning = Planning()
    built: list[WritersPlan] = []

    class Counted(WritersPlan):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(prepare_module, "WritersPlan", Counted)
    _run(spark, pg_dsn, tmp_path, lake, landing, planning.by_column, "slots")
    assert planning.calls == 2  # one plan a slot, for six windows
    assert len(built) == 2  # and one writers' step a slot


@dataclass(frozen=True)
class _ParseLogged:
    """`_parse`, noting in `log` (one line a batch, on the executors) which file it parsed."""

    log: str

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            with open(self.log, "a") as out:
                out.writelines(
                    f"{name}\n" for name in set(batch.column("_source_file").to_pylist())
                )
            yield from _parse(iter([batch]))


def test_a_slots_plan_reads_each_windows_rows_once_and_leaves_no_cache_behind(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """The plan Spark makes for a slot's first window runs again for its later windows: each
    window's parsed rows are cached again in the same cache entries, so every output reads them
    from there (parsing each file once), and the entries go with the run."""
    log = tmp_path / "parsed.log"
    manager = spark._jsparkSession.sharedState().cacheManager()
    entries = manager.numCachedEntries()
    _run(
        spark, pg_dsn, tmp_path, lake, landing, Planning().by_column, "once", _ParseLogged(str(log))
    )
    parsed = Counter(log.read_text().split())
    assert parsed == Counter({f"once/f{i}.txt": 1 for i in range(len(WINDOWS))})
    assert manager.numCachedEntries() == entries


def test_a_context_read_in_a_task_is_the_tasks_window(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    planning = Planning()
    _run(spark, pg_dsn, tmp_path, lake, landing, planning.by_udf, "in_task")
    assert planning.calls == 2


@pytest.mark.parametrize("transform", ["by_literal", "with_outside_rows", "with_eager_count"])
def test_a_plan_that_holds_for_one_window_only_is_made_for_each(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, transform: str
) -> None:
    planning = Planning()
    _run(spark, pg_dsn, tmp_path, lake, landing, getattr(planning, transform), transform)
    # The first window is planned for any window, found not to hold, and planned alone.
    assert planning.calls == len(WINDOWS) + 1


@pytest.mark.parametrize("transform", ["with_own_aggregate", "repartitioned"])
def test_a_plan_whose_steps_exchange_rows_computes_each_windows_own(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, transform: str
) -> None:
    """Spark runs a shuffle's map stage, a broadcast or a subquery once per physical plan and
    takes the results again when the plan runs again: such a plan is still made once a slot,
    but Spark plans it again for each window, and no window gets another's rows."""
    planning = Planning()
    _run(spark, pg_dsn, tmp_path, lake, landing, getattr(planning, transform), transform)
    assert planning.calls == 2


def _stamped(rows: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    """Points drawn at random: other values each time the window is computed."""
    drawn = rows.withColumn("points", (F.rand() * 100).cast("bigint"))
    return _outputs(drawn.withColumn("_window_id", ctx.window_id_column()))


def test_a_deterministic_job_whose_output_varies_is_refused_before_any_write(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    _land(landing, "stamped")
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = _job(_stamped, "stamped")
    with pytest.raises(ConfigurationError, match=r"declares deterministic=True, but its output "
                       r"'events' uses rand\(\).*Remove deterministic=True"):  # fmt: skip
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert not (lake / "stamped" / "events").exists()
    # Not declared deterministic: each window's outputs are computed once and staged.
    staged = dataclasses.replace(job, deterministic=False)
    result = Engine(staged, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in result.windows] == list(range(1, len(WINDOWS) + 1))
