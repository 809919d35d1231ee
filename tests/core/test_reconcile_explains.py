"""Reconcile explains itself, by key only, and an upsert sink's expected state is what the run
applies: the last window's row per key wins, also over a window reconcile cannot recompute.

The user's job (tests/support/user_project): the report through the real command
(`reconcile --dry-run --json`), the refusal and the repair in-process on the session's Spark
through `onceflow.ops` (a CLI process adds a JVM start and nothing those steps assert): the CLI
finding the job is test_user_jobs.py's, the text report and its exit codes test_sink_state.py's
and test_s3_lake.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow._diff import DiffSample
from onceflow.errors import OnceflowError
from onceflow.reconcile import ReconcileReport, SinkDiff, format_report
from onceflow.settings import Settings
from tests.support.cli import CliRun, cli_env
from tests.support.orders_data import (
    FOLDER,
    USER_PROJECT,
    assert_orders_exact,
    one_file_per_window,
    user_project_on_path,
    write_orders,
)

# Values of the columns that are not the key, as the damaged rows hold them: no report or
# message may show one (only keys and window ids).
_VALUES = ("eve", "grace", "zed", "heidi", "999", "4200", "4201", "77")


def _table(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute("SELECT xmin::text, * FROM public.orders").fetchall())


@pytest.mark.slow
def test_reconcile_of_an_upsert_sink_names_keys_and_repairs_exactly(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    write_orders(landing)
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    with user_project_on_path() as user:
        orders = user.ORDERS
        ops.run(orders, settings, spark=spark, dsn=pg_dsn, max_units_per_window=1)
    windows = one_file_per_window()
    assert_orders_exact(pg_dsn, windows)  # o2 of window 1 overwritten by window 3

    # A row appended to window 3's committed file: `run` takes nothing from it, and window 3
    # can no longer be recomputed (its rows, o2's among them, are left alone).
    with open(landing / FOLDER / "orders-003.csv", "a") as out:
        out.write("2024-05-03T12:00:00Z,o10,5,Judy\n")
    # Damage by hand: o5 deleted, o7 changed, o99 added (all window 2); o8 (window 3) takes
    # o5's customer, under a unique index the job knows nothing of.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM public.orders WHERE order_id = 'o5'")
        conn.execute("UPDATE public.orders SET amount_cents = 4201 WHERE order_id = 'o7'")
        conn.execute(
            "INSERT INTO public.orders VALUES ('o99', 'zed', 77, '2024-05-02T10:00:00Z', 2)"
        )
        conn.execute("UPDATE public.orders SET customer = 'eve' WHERE order_id = 'o8'")
        conn.execute("CREATE UNIQUE INDEX orders_customer_key ON public.orders (customer)")

    def reconcile(dry_run: bool = False) -> ReconcileReport:
        with user_project_on_path():
            return ops.reconcile(orders, settings, spark=spark, dsn=pg_dsn, dry_run=dry_run)

    # The report as the command prints it.
    env = cli_env(home=tmp_path / "home", dsn=pg_dsn, lake=lake, landing=landing)
    env["ONCEFLOW_JOBS"] = "orders_jobs"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(USER_PROJECT), env.get("PYTHONPATH", "")) if p
    )
    done = CliRun(["reconcile", "orders", "--dry-run", "--json"], env, tmp_path / "logs").finish()
    assert done.returncode == 0, done.stderr[-3000:]
    dry = done.stdout
    report = json.loads(dry)
    sinks = {s["sink"]: s for s in report["sinks"]}
    pg = sinks["pg_orders"]
    assert (pg["missing"], pg["extra"], pg["changed"]) == (1, 1, 1), dry
    assert pg["first_differences"] == [
        {"kind": "changed", "key": {"order_id": "o7"}, "rows": 1,
         "expected_window": 2, "actual_window": 2},
        {"kind": "extra", "key": {"order_id": "o99"}, "rows": 1,
         "expected_window": None, "actual_window": 2},
        {"kind": "missing", "key": {"order_id": "o5"}, "rows": 1,
         "expected_window": 2, "actual_window": None},
    ]  # fmt: skip
    assert sinks["orders_quarantine"]["clean"], dry
    assert [u["window_id"] for u in report["unverifiable"]] == [3]
    assert report["windows_checked"] == [1, 2]
    assert not any(value in dry.lower() for value in _VALUES), dry

    # The repair cannot apply under the user's index: it says which key, and changes nothing.
    before = _table(pg_dsn)
    # What the CLI prints on stderr is `exc.message`, and exits with `ops.exit_code(exc)`.
    with pytest.raises(OnceflowError) as refused:
        reconcile()
    assert ops.exit_code(refused.value) == ops.EXIT_FAILED == 1
    message = ops.redact(refused.value.message)
    assert "PostgreSQL refused the repair (UniqueViolation" in message
    assert "constraint orders_customer_key" in message
    assert "the rows to insert for order_id=o5 collide with rows the table keeps" in message
    assert not any(value in message.lower() for value in _VALUES), message
    assert _table(pg_dsn) == before

    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP INDEX public.orders_customer_key")
        conn.execute("UPDATE public.orders SET customer = 'heidi' WHERE order_id = 'o8'")
    repaired = format_report(reconcile())  # as `reconcile` prints it
    assert "pg_orders changed: order_id=o7 (expected from window 2, held from window 2)" in (
        repaired
    )
    assert "pg_orders missing: order_id=o5 (expected from window 2)" in repaired
    assert "pg_orders extra: order_id=o99 (held from window 2)" in repaired
    assert_orders_exact(pg_dsn, windows)


def test_report_names_first_differences_by_key_and_counts_the_rest() -> None:
    keyed = [DiffSample("missing", (("order_id", f"o{i}"),), 1, 2, None) for i in range(5)]
    report = ReconcileReport(
        job="orders",
        mode="full",
        dry_run=True,
        windows_checked=[1, 2],
        unverifiable=[(3, "orders/orders-003.csv: size 170, expected 138")],
        sinks=[
            SinkDiff("pg_orders", 7, 0, 0, False, samples=tuple(keyed)),
            SinkDiff(
                "lake_orders", 3, 2, 0, False,
                samples=(DiffSample("extra", (), 2, None, 4), DiffSample("missing", (), 3, 2)),
            ),
            SinkDiff("orders_quarantine", 0, 0, 0, False),
        ],
        wall_s=1.0,
    )  # fmt: skip
    text = format_report(report)
    assert (
        "pg_orders missing: order_id=o0 (expected from window 2); order_id=o1 (expected from "
        "window 2); order_id=o2 (expected from window 2); order_id=o3 (expected from window 2);"
        " order_id=o4 (expected from window 2); and 2 more row(s)"
    ) in text
    assert "lake_orders extra: 2 row(s) of window 4" in text
    assert "lake_orders missing: 3 row(s) of window 2" in text
    assert "orders_quarantine" in text and "orders_quarantine missing" not in text
    data = report.as_json()
    assert data["clean"] is False
    assert data["sinks"][0]["first_differences"][0] == {
        "kind": "missing",
        "key": {"order_id": "o0"},
        "rows": 1,
        "expected_window": 2,
        "actual_window": None,
    }
    assert data["sinks"][2] == {
        "sink": "orders_quarantine", "missing": 0, "extra": 0, "changed": 0, "repaired": False,
        "skipped": None, "clean": True, "first_differences": [],
    }  # fmt: skip
    json.dumps(data)
