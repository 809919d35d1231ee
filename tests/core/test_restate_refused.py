"""A refused operation leaves nothing behind, and an unfinished restatement can be cancelled:
the user's own jobs (the README's `ORDERS`, and tests/support/user_project). A real CLI process
where the process is the property (a restatement killed by a signal mid-way, a refusal's exit
code and stderr, `restate --cancel`'s report); the rest in-process through `onceflow.ops` on the
session's Spark, which a CLI process only presents (`status --json` is `ops.status(...).as_json()`,
its text `ops.format_status`, a refusal's stderr `exc.message`, its exit code `ops.exit_code`)."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.errors import OnceflowError
from onceflow.job import Job
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
    """One installation of onceflow with one job module (`job`, as the CLI finds it): driven
    through the real CLI (`cli`, `ok`) or in-process on the session's Spark."""

    def __init__(
        self, tmp_path: Path, pg_dsn: str, landing: Path, lake: Path, module: str, job: Job
    ):
        self.tmp, self.dsn, self.landing, self.job = tmp_path, pg_dsn, landing, job
        self.env = cli_env(home=tmp_path / "home", dsn=pg_dsn, lake=lake, landing=landing)
        self.env["ONCEFLOW_JOBS"] = module
        self.settings = Settings(
            home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing
        )

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
        """What `status orders --json` prints."""
        return ops.status(self.job, self.settings, dsn=self.dsn).as_json()

    def status_text(self) -> str:
        """What `status orders` prints."""
        return ops.format_status(ops.status(self.job, self.settings, dsn=self.dsn).status)

    def run(self, spark: Any, **kwargs: Any) -> ops.WindowsResult:
        return ops.run(self.job, self.settings, spark=spark, dsn=self.dsn, **kwargs)

    def refused(self, operation: Any, *args: Any, **kwargs: Any) -> str:
        """`operation` refused with the CLI's exit code 1: its message, as stderr shows it."""
        with pytest.raises(OnceflowError) as refusal:
            operation(self.job, *args, settings=self.settings, dsn=self.dsn, **kwargs)
        assert ops.exit_code(refusal.value) == ops.EXIT_FAILED == 1
        return ops.redact(refusal.value.message)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return sorted(conn.execute(query).fetchall(), key=str)


def test_a_refused_restatement_records_nothing_and_the_job_goes_on(
    spark: Any,
    pg_dsn: str,
    tmp_path: Path,
    lake: Path,
    landing: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "readme_orders.py").write_text(README_JOB)
    monkeypatch.syspath_prepend(str(project))
    job = importlib.import_module("readme_orders").ORDERS
    sys.modules.pop("readme_orders")  # the CLI processes import their own
    user = User(tmp_path, pg_dsn, landing, lake, "readme_orders", job)
    user.on_path(project)
    folder = landing / "orders"
    folder.mkdir()

    def land(name: str) -> None:
        lines = "".join(f"{o},{a}\n" for o, a in README_FILES[name])
        (folder / name).write_text("order_id,amount_cents\n" + lines)

    land("orders-1.csv")
    land("orders-2.csv")
    user.run(spark, max_units_per_window=1)
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
    skip = user.refused(ops.skip, [2], "typo")
    assert "only pending windows" in skip and "Nothing was recorded" in skip
    assert user.status()["epoch"] == before["epoch"]

    # New input is run as if nothing had been asked.
    land("orders-3.csv")
    run = user.run(spark)
    assert len(run.windows) == 1, run
    truth: dict[str, int] = {}
    for name in sorted(README_FILES):
        truth.update(dict(README_FILES[name]))
    assert user.rows("SELECT order_id, amount_cents FROM public.orders") == sorted(truth.items())
    assert "restatements not finished" not in user.status_text()


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
    write_orders(landing)
    with user_project_on_path() as project:
        user = User(tmp_path, pg_dsn, landing, lake, "orders_jobs", project.ORDERS)
        user.run(spark, max_units_per_window=1)
    user.on_path(USER_PROJECT)
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
    text = user.status_text()
    assert "restatements not finished: window 2 (seq 1, request fix-2)" in text
    assert "`onceflow restate orders --cancel fix-2` gives them up" in text

    unknown = user.refused(ops.cancel_restatement, "fix-9")
    assert "no restatement request 'fix-9'" in unknown
    cancelled = user.ok("restate", "orders", "--cancel", "fix-2", "--reason", "wrong fix")
    assert "window 2: restatement cancelled (seq 1, request fix-2): wrong fix" in cancelled.stdout
    again = ops.cancel_restatement(user.job, "fix-2", settings=user.settings, dsn=pg_dsn)
    assert [(i.window_id, i.seq, i.cancelled) for i in again.cancelled] == [(2, 1, "wrong fix")]
    assert again.reason == "wrong fix"  # changes nothing
    status = user.status()
    assert status["restatements_pending"] == []
    assert [
        (r["window_id"], r["request"], r["reason"]) for r in status["restatements_cancelled"]
    ] == [(2, "fix-2", "wrong fix")]
    assert "restatement of window 2 cancelled (seq 1, request fix-2): wrong fix" in (
        user.status_text()
    )

    # A restatement some sink applied is not for cancelling: the next run finishes it.
    args = ["restate", "orders", "--windows", "1", "--request-id", "fix-1"]
    killed = user.cli(*args, fault="restated@1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    window_1 = _window_rows(user, 1)
    refused = user.refused(ops.cancel_restatement, "fix-1")
    assert "is already applied in orders_quarantine, pg_orders" in refused
    assert "`onceflow run orders` finishes it" in refused

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
    with user_project_on_path():
        run = user.run(spark)
    assert len(run.windows) == 1, run
    assert_orders_exact(pg_dsn, [*windows, ["orders-004.csv"]])
    assert _window_rows(user, 1) == window_1
    assert _window_rows(user, 2) == [r for r in window_2 if r[1] != "o5"]  # o5 moved on
    assert user.status()["restatements_pending"] == []
    markers = user.rows("SELECT sink, seq FROM onceflow.restate_commits WHERE job = 'orders'")
    assert markers == [("orders_quarantine", 2), ("pg_orders", 2)]  # fix-1's only
