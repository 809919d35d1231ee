"""A user's bug is fixable by fixing the code, through the real `onceflow` command.

The README's `orders` job meets ordinary input (two files of one window with the same key):
the refusal names the fix, the fixed code computes the pending window again after `onceflow
windows recompute` (its input kept, never skipped), and a refused recompute changes nothing.
An upsert that declares `order_by=` keeps the newest row of each key within a window and
across windows (a late event never replaces a newer row), through a restatement and reconcile
(in-process on the session's Spark: that rule is the property, not the command).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg

from onceflow import Job, ops
from onceflow.settings import Settings
from tests.support.cli import CliRun, Finished, cli_env

README_JOB = """
from onceflow import CsvSource, Job, PostgresSink

ORDERS = Job(
    name="orders",
    source=CsvSource("orders", schema={"order_id": "string", "amount_cents": "bigint"}),
    transform=TRANSFORM,
    sinks=(PostgresSink("pg_orders", "orders", table="orders", key=("order_id",), mode="upsert",
                        columns={"order_id": "text", "amount_cents": "bigint"}),),
)
"""
AS_IN_README = 'lambda rows, ctx: {"orders": rows.select("order_id", "amount_cents")}'
# The user's fix: one row per order, its greatest amount.
FIXED = (
    'lambda rows, ctx: {"orders": rows.groupBy("order_id")'
    '.agg({"amount_cents": "max"}).withColumnRenamed("max(amount_cents)", "amount_cents")}'
)


class User:
    """One installation of onceflow with one job module of its own, driven through the CLI."""

    def __init__(self, tmp_path: Path, pg_dsn: str, landing: Path, lake: Path) -> None:
        self.tmp, self.dsn = tmp_path, pg_dsn
        self.project = tmp_path / "project"
        self.project.mkdir()
        self.folder = landing / "orders"
        self.folder.mkdir(parents=True)
        self.env = cli_env(home=tmp_path / "home", dsn=pg_dsn, lake=lake, landing=landing)
        path = self.env.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.project), path) if p)
        self.env["ONCEFLOW_JOBS"] = "my_orders"
        self.settings = Settings(
            home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing
        )

    def write_job(self, text: str) -> None:
        (self.project / "my_orders.py").write_text(text)

    def land(self, name: str, header: str, lines: list[str]) -> None:
        (self.folder / name).write_text("".join(f"{line}\n" for line in [header, *lines]))

    def cli(self, *args: str) -> Finished:
        return CliRun(list(args), self.env, self.tmp / "logs").finish()

    def ok(self, *args: str) -> Finished:
        done = self.cli(*args)
        assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done

    def status(self) -> dict[str, Any]:
        return json.loads(self.ok("status", "orders", "--json").stdout)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return sorted(conn.execute(query).fetchall(), key=str)


def _stages(lake: Path) -> list[str]:
    folder = lake / "_onceflow" / "staging" / "orders"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_fixed_transform_recomputes_the_pending_window(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    user = User(tmp_path, pg_dsn, landing, lake)
    user.write_job(README_JOB.replace("TRANSFORM", AS_IN_README))
    # Two files of one window hold o2: ordinary input the README's transform passes on.
    user.land("orders-1.csv", "order_id,amount_cents", ["o1,100", "o2,200"])
    user.land("orders-2.csv", "order_id,amount_cents", ["o2,250", "o3,300"])
    refused = user.cli("run", "orders")
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "has 1 more row(s) than keys ['order_id']" in refused.stderr
    assert "`onceflow windows recompute orders 1`" in refused.stderr
    assert "order_by=" in refused.stderr
    assert user.rows("SELECT * FROM public.orders") == []
    assert _stages(lake), "the window's outputs were staged"

    # The user fixes the transform; the staged outputs of the old code still stand in the way.
    user.write_job(README_JOB.replace("TRANSFORM", FIXED))
    again = user.cli("run", "orders")
    assert again.returncode == 1 and "1 more row(s) than keys" in again.stderr

    # Refusals change nothing: the input must be readable (the stage is all that would be
    # left of it otherwise), and no epoch is taken.
    epoch = user.status()["epoch"]
    (user.folder / "orders-2.csv").rename(tmp_path / "orders-2.csv")
    gone = user.cli("windows", "recompute", "orders", "1")
    assert gone.returncode == 1, gone.stderr[-2000:]
    assert "window 1's input is no longer readable" in gone.stderr
    assert "Nothing was changed" in gone.stderr
    assert _stages(lake) and user.status()["epoch"] == epoch
    (tmp_path / "orders-2.csv").rename(user.folder / "orders-2.csv")
    never = user.cli("windows", "recompute", "orders", "7")
    assert never.returncode == 1 and "window 7 was never planned" in never.stderr

    done = user.ok("windows", "recompute", "orders", "1")
    assert "computes them again with the job's current code" in done.stdout
    assert _stages(lake) == []
    assert user.status()["epoch"] > epoch  # a run working on the window is fenced

    # The run of the fixed code in-process on the session's Spark (the command found and ran
    # the user's module above; what the recomputed window commits is the property here).
    run = ops.run(_job_of(README_JOB.replace("TRANSFORM", FIXED)), user.settings, spark=spark,
                  dsn=pg_dsn)  # fmt: skip
    assert len(run.windows) == 1, run.as_json()
    assert user.rows("SELECT order_id, amount_cents FROM public.orders") == [
        ("o1", 100),
        ("o2", 250),
        ("o3", 300),
    ]
    status = user.status()
    assert status["last_window"] == 1 and status["pending"] == [] and status["skipped"] == []

    committed = user.cli("windows", "recompute", "orders", "1")
    assert committed.returncode == 1
    assert "window 1 is committed in every sink" in committed.stderr
    assert "onceflow restate orders --windows 1" in committed.stderr


ORDERED_JOB = """
from onceflow import CsvSource, Job, PostgresSink
from pyspark.sql import functions as F

ORDERS = Job(
    name="orders",
    source=CsvSource("orders", schema={"order_id": "string", "amount_cents": "bigint",
                                       "updated_at": "timestamp"}),
    transform=lambda rows, ctx: {"orders": rows.select(
        "order_id", "amount_cents", "updated_at",
        F.lit(ctx.window_id).cast("bigint").alias("window_id"),
        "_file_idx", "_source_line",  # a tie goes to the later record
    )},
    sinks=(PostgresSink("pg_orders", "orders", table="orders", key=("order_id",), mode="upsert",
                        columns={"order_id": "text", "amount_cents": "bigint",
                                 "updated_at": "timestamptz", "window_id": "bigint"},
                        window_column="window_id", order_by="updated_at"),),
)
"""
HEADER = "order_id,amount_cents,updated_at"
# One file per window (--max-files-per-window 1).
CHANGES = {
    "orders-1.csv": [
        "o1,100,2024-05-01T10:00:00Z",
        "o1,90,2024-05-01T09:00:00Z",  # older, later in the file: o1 stays 100
        "o2,200,2024-05-01T10:00:00Z",
        "o2,210,2024-05-01T10:00:00Z",  # a tie: the later line wins
        "o3,300,2024-05-01T12:00:00Z",
    ],
    "orders-2.csv": [
        "o3,999,2024-05-01T11:00:00Z",  # late and out of order: never replaces o3's newer row
        "o1,111,2024-05-01T11:00:00Z",  # newer: replaces
        "o4,40,",
        "o5,50,2024-05-01T10:00:00Z",
    ],
    "orders-3.csv": [
        "o4,41,",  # no time in either: the later window wins
        "o5,0,",  # no time is the least: o5 stays 50
    ],
}
NEWEST = [("o1", 111, 2), ("o2", 210, 1), ("o3", 300, 1), ("o4", 41, 3), ("o5", 50, 2)]


def test_an_upsert_keeps_the_newest_row_by_its_order_by_column(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    user = User(tmp_path, pg_dsn, landing, lake)
    job = _job_of(ORDERED_JOB)
    settings = user.settings
    for name, lines in CHANGES.items():
        user.land(name, HEADER, lines)
    ops.run(job, settings, spark=spark, dsn=pg_dsn, max_units_per_window=1)
    query = "SELECT order_id, amount_cents, window_id FROM public.orders"
    assert user.rows(query) == NEWEST

    # A restatement of window 2 applies the same rule against the windows around it.
    ops.restate(job, [2], settings, spark=spark, dsn=pg_dsn)
    assert user.rows(query) == NEWEST

    # Reconcile's expected state picks the same rows: clean, nothing to repair.
    report = ops.reconcile(job, settings, spark=spark, dsn=pg_dsn, dry_run=True).as_json()
    assert report["clean"] is True, report
    (sink,) = report["sinks"]
    assert sink["clean"] is True and sink["first_differences"] == [], report


def _job_of(module_text: str) -> Job:
    """The `ORDERS` job a user's module of this text defines."""
    namespace: dict[str, Any] = {}
    exec(compile(module_text, "my_orders.py", "exec"), namespace)
    return namespace["ORDERS"]
