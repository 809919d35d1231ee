"""A refused operation leaves nothing behind, and an unfinished restatement can be cancelled:
the user's own jobs (the README's `ORDERS`, and tests/support/user_project), the real CLI (a
first run that only sets the scene is in-process, on the session's Spark)."""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.settings import Settings
from tests.support.cli import CliRun, Finished, cli_env
from tests.support.orders_data import (
    FILES,
    USER_PROJECT,
    UTC,
    Order,
    assert_orders_exact,
    one_file_per_window,
    user_project_on_path,
    write_orders,
)

pytestmark = pytest.mark.slow

# The README's own example job, word for word (README.md, "Your own job").
README_JOB = """
from onceflow import CsvSource, Job, PostgresSink

ORDERS = Job(
    name="orders",
    source=CsvSource("orders", schema={"order_id": "string", "amount_cents": "bigint"}),
    transform=lambda rows, ctx: {"orders": rows.select("order_id", "amount_cents")},
    sinks=(PostgresSink("pg_orders", "orders", table="orders", key=("order_id",), mode="upsert",
                        columns={"order_id": "text", "amount_cents": "bigint"}),),
)
"""

# The README job's files, one window each; o2 comes again in the second and wins.
README_FILES = {
    "orders-1.csv": [("o1", 100), ("o2", 200)],
    "orders-2.csv": [("o3", 300), ("o2", 250)],
    "orders-3.csv": [("o4", 400)],
}


class User:
    """One installation of onceflow with one job module, driven through the real CLI."""

    def __init__(self, tmp_path: Path, pg_dsn: str, landing: Path, lake: Path, module: str):
        self.tmp, self.dsn, self.landing = tmp_path, pg_dsn, landing
        self.env = cli_env(home=tmp_path / "home", dsn=pg_dsn, lake=lake, landing=landing)
        self.env["ONCEFLOW_JOBS"] = module

    def on_path(self, folder: Path) -> None:
        path = self.env.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), path) if p)

    def cli(self, *args: str, fault: str | None = None) -> Finished:
        env = dict(self.env, **({"ONCEFLOW_FAULT": fault} if fault else {}))
        return CliRun(list(args), env, self.tmp / "logs").finish()

    def ok(self, *args: str) -> Finished:
        done = self.cli(*args)
        assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
        return done

    def status(self) -> dict[str, Any]:
        return json.loads(self.ok("status", "orders", "--json").stdout)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return sorted(conn.execute(query).fetchall(), key=str)


def test_a_refused_restatement_records_nothing_and_the_job_goes_on(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "readme_orders.py").write_text(README_JOB)
    user = User(tmp_path, pg_dsn, landing, lake, "readme_orders")
    user.on_path(project)
    folder = landing / "orders"
    folder.mkdir()

    def land(name: str) -> None:
        lines = "".join(f"{o},{a}\n" for o, a in README_FILES[name])
        (folder / name).write_text("order_id,amount_cents\n" + lines)

    land("orders-1.csv")
    land("orders-2.csv")
    user.ok("run", "orders", "--max-files-per-window", "1")
    before = user.status()
    assert before["last_window"] == 2

    # The sink has no window_column: the restatement is refused, and nothing is recorded.
    refused = user.cli("restate", "orders", "--windows", "2")
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert user.rows("SELECT * FROM onceflow.restatements") == []
    assert "pg_orders: has no window_column" in refused.stderr
    assert "Nothing was recorded" in refused.stderr
    after = user.status()
    assert after["restatements_pending"] == []
    assert after["epoch"] == before["epoch"]  # no running job was fenced either

    # A refused skip takes no epoch either.
    skip = user.cli("windows", "skip", "orders", "2", "--reason", "typo")
    assert skip.returncode == 1 and "only pending windows" in skip.stderr
    assert "Nothing was recorded" in skip.stderr
    assert user.status()["epoch"] == before["epoch"]

    # New input is run as if nothing had been asked.
    land("orders-3.csv")
    run = user.ok("run", "orders")
    assert "1 window(s)" in run.stdout, run.stdout
    truth: dict[str, int] = {}
    for name in sorted(README_FILES):
        truth.update(dict(README_FILES[name]))
    assert user.rows("SELECT order_id, amount_cents FROM public.orders") == sorted(truth.items())
    assert "restatements not finished" not in user.ok("status", "orders").stdout


def _window_rows(user: User, window: int) -> list[tuple[Any, ...]]:
    """The window's rows with the transaction that wrote them: a rewrite shows."""
    return user.rows(f"SELECT xmin::text, * FROM public.orders WHERE window_id = {window}")


def test_a_restatement_cut_short_is_cancelled_and_the_job_goes_on(
    spark: Any,
    pg_dsn: str,
    tmp_path: Path,
    lake: Path,
    landing: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = User(tmp_path, pg_dsn, landing, lake, "orders_jobs")
    user.on_path(USER_PROJECT)
    write_orders(landing)
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    with user_project_on_path() as project:
        ops.run(project.ORDERS, settings, spark=spark, dsn=pg_dsn, max_units_per_window=1)
    windows = one_file_per_window()
    assert_orders_exact(pg_dsn, windows)
    window_2 = _window_rows(user, 2)

    # Killed before the sinks' COMMIT: restatement written ahead, applied nowhere.
    args = ["restate", "orders", "--windows", "2", "--request-id", "fix-2"]
    killed = user.cli(*args, fault="before_pg_commit@2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    pending = user.status()["restatements_pending"]
    assert [(r["seq"], r["window_id"], r["request"]) for r in pending] == [(1, 2, "fix-2")]
    assert pending[0]["cancel"] == "onceflow restate orders --cancel fix-2"
    text = user.ok("status", "orders").stdout
    assert "restatements not finished: window 2 (seq 1, request fix-2)" in text
    assert "`onceflow restate orders --cancel fix-2` gives them up" in text

    unknown = user.cli("restate", "orders", "--cancel", "fix-9")
    assert unknown.returncode == 1 and "no restatement request 'fix-9'" in unknown.stderr
    cancelled = user.ok("restate", "orders", "--cancel", "fix-2", "--reason", "wrong fix")
    assert "window 2: restatement cancelled (seq 1, request fix-2): wrong fix" in cancelled.stdout
    again = user.ok("restate", "orders", "--cancel", "fix-2")  # changes nothing
    assert "window 2: restatement cancelled (seq 1, request fix-2): wrong fix" in again.stdout
    status = user.status()
    assert status["restatements_pending"] == []
    assert [
        (r["window_id"], r["request"], r["reason"]) for r in status["restatements_cancelled"]
    ] == [(2, "fix-2", "wrong fix")]
    assert "restatement of window 2 cancelled (seq 1, request fix-2): wrong fix" in (
        user.ok("status", "orders").stdout
    )

    # A restatement some sink applied is not for cancelling: the next run finishes it.
    args = ["restate", "orders", "--windows", "1", "--request-id", "fix-1"]
    killed = user.cli(*args, fault="restated@1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    window_1 = _window_rows(user, 1)
    refused = user.cli("restate", "orders", "--cancel", "fix-1")
    assert refused.returncode == 1
    assert "is already applied in orders_quarantine, pg_orders" in refused.stderr
    assert "`onceflow run orders` finishes it" in refused.stderr

    # New input: the run finishes fix-1 (applied already: nothing changes), never applies
    # fix-2, and commits the new window; every sink ends exact.
    o5 = Order("o5", "Eve", 1000, datetime(2024, 5, 2, 8, tzinfo=UTC))
    monkeypatch.setitem(
        FILES,
        "orders-004.csv",
        [
            ("order_id,customer,amount_cents,ordered_at", None),
            ("o5,Eve,1000,2024-05-02T08:00:00Z", o5),
        ],
    )
    write_orders(landing, ["orders-004.csv"])
    run = user.ok("run", "orders")
    assert "1 window(s)" in run.stdout, run.stdout
    assert_orders_exact(pg_dsn, [*windows, ["orders-004.csv"]])
    assert _window_rows(user, 1) == window_1
    assert _window_rows(user, 2) == [r for r in window_2 if r[1] != "o5"]  # o5 moved on
    assert user.status()["restatements_pending"] == []
    markers = user.rows("SELECT sink, seq FROM onceflow.restate_commits WHERE job = 'orders'")
    assert markers == [("orders_quarantine", 2), ("pg_orders", 2)]  # fix-1's only
