"""`daily_totals` is exact: the payments Delta table's changes reach the totals exactly once.

In-process: new payments, windows of several sizes, a re-run with nothing new, rows deleted from
the Delta table by hand (retractions) and put back by reconcile (additions), a restatement of a
payments window with another transform (retractions and additions in one version). After each
step `public.daily_totals` must equal the plain-Python oracle exactly.

Slow: real `onceflow run daily_totals` processes killed with SIGKILL at each fault point of its
own window; new payments committed before the recovery run, both in-process on the session's
Spark (`onceflow.ops.run`).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import time
from collections.abc import Mapping
from datetime import date
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import ops
from onceflow.engine import Engine, RunResult
from onceflow.generate import generate_payments
from onceflow.job import WindowContext
from onceflow.jobs.payments import transform_payments
from onceflow.reconcile import format_report, reconcile
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from tests.support.cli import CliRun, Finished, cli_env
from tests.support.daily_totals_oracle import (
    Totals,
    actual_totals,
    assert_totals_exact,
    delta_payment_rows,
    diff_totals,
    totals_from_delta,
    totals_from_landing,
)
from tests.support.matrix import points
from tests.support.oracle import expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact


def test_comparison_counts_lost_doubled_changed_and_zero_rows() -> None:
    """The comparison itself can fail: each kind of difference is counted."""
    d1, d2, d3, d4 = (date(2024, 2, day) for day in (27, 28, 29, 1))
    truth = {(d1, "USD"): (10**20, 3), (d2, "EUR"): (-5, 2), (d3, "JPY"): (7, 1)}
    exact = [(d1, "USD", 10**20, 3), (d2, "EUR", -5, 2), (d3, "JPY", 7, 1)]
    assert diff_totals(truth, exact).exact
    damaged = [
        (d1, "USD", 10**20 + 1, 3),  # right count, total off by one cent
        (d2, "EUR", -10, 4),  # doubled
        (d4, "GBP", 0, 0),  # a row for a (day, currency) without payments
    ]  # (d3, JPY) lost
    diff = diff_totals(truth, damaged)
    assert (diff.lost_keys, diff.doubled_keys, diff.changed_keys) == (1, 2, 1), diff.summary()
    assert (diff.lost, diff.doubled) == (1, 2), diff.summary()
    assert not diff.exact


def _flat_fee(valid: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return transform_payments(valid.withColumn("amount_cents", F.lit(1).cast("bigint")), ctx)


def _changed_windows(result: RunResult) -> list[int]:
    return [w.window_id for w in result.windows if not w.noop]


def _both_oracles(landing: Path, lake: Path, amounts: dict[str, int] | None = None) -> Totals:
    """The landing files' truth, after checking the Delta table's current rows agree with it."""
    from_landing = totals_from_landing(landing, amounts=amounts)
    from_delta = totals_from_delta(lake)
    assert from_delta == from_landing, "the payments Delta table disagrees with the landing files"
    return from_landing


def test_daily_totals_follow_payments_through_new_input_repair_and_restatement(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    settings.check_folders()
    payments_job = get_job("payments")
    totals_job = get_job("daily_totals")
    payments = Engine(payments_job, settings, spark, pg_dsn)
    totals = Engine(totals_job, settings, spark, pg_dsn)
    started = time.monotonic()

    # 1. A first batch, in two payments windows, then one daily_totals run over all versions.
    generate_payments(
        landing, records=400, files=4, duplicate_rate=0.15, invalid_rate=0.05, seed=21
    )
    batch_1 = visible_files(landing)
    payments.run(max_units_per_window=2)
    truth = _both_oracles(landing, lake)
    assert sum(c for _, c in truth.values()) == 400
    first = totals.run()
    assert len(_changed_windows(first)) == 1
    assert_totals_exact(truth, pg_dsn, "first batch")

    # 2. Nothing new: a re-run of daily_totals plans nothing and changes nothing.
    before = sorted(actual_totals(pg_dsn))
    assert _changed_windows(totals.run()) == []
    assert sorted(actual_totals(pg_dsn)) == before

    # 3. More payments (new ids, and a late file that only repeats earlier ids), and a payments
    #    run with nothing new (it still commits its epoch claim, an empty table version); then
    #    daily_totals with one table version per window.
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=22)
    generate_payments(landing, records=60, files=1, seed=21)  # all duplicates of batch 1
    payments.run(max_units_per_window=3)
    assert _changed_windows(payments.run()) == []
    truth = _both_oracles(landing, lake)
    assert sum(c for _, c in truth.values()) == 700
    second = totals.run(max_units_per_window=1)
    assert len(_changed_windows(second)) >= 3, [w.offsets for w in second.windows]
    assert all(w.offsets["start"] == w.offsets["end"] for w in second.windows)
    assert_totals_exact(truth, pg_dsn, "second batch, one version per window")

    # 4. Damage from outside onceflow: rows deleted from the Delta table. daily_totals sees the
    #    delete as retractions; a (day, currency) left without payments loses its row.
    rows = delta_payment_rows(lake)
    by_key: dict[tuple, list[str]] = {}
    for pid, _, currency, created, _ in rows:
        by_key.setdefault((created.date(), currency), []).append(pid)
    alone = sorted(ids[0] for ids in by_key.values() if len(ids) == 1)[:3]
    shared = sorted(ids[0] for ids in by_key.values() if len(ids) > 1)[:2]
    victims = alone + shared
    assert len(alone) == 3, "the input should have (day, currency) keys with one payment"
    table = DeltaTable(str(lake / "payments"))
    table.delete("payment_id IN (" + ", ".join(f"'{pid}'" for pid in victims) + ")")
    damaged = totals_from_delta(lake)
    assert sum(c for _, c in damaged.values()) == 700 - len(victims)
    totals.run()
    assert_totals_exact(damaged, pg_dsn, "after a hand-run delete on the Delta table")
    assert len(actual_totals(pg_dsn)) == len(truth) - len(alone)

    #    Reconcile puts the rows back (additions): the totals are whole again.
    report = reconcile(payments)
    print(format_report(report))
    lake_diff = next(s for s in report.sinks if s.sink == "lake_payments")
    assert (lake_diff.missing, lake_diff.extra, lake_diff.changed) == (len(victims), 0, 0)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    totals.run(max_units_per_window=3)
    assert_totals_exact(_both_oracles(landing, lake), pg_dsn, "after reconcile repaired it")

    # 5. A restatement of payments window 1 (its first two files) with a flat fee: its rows are
    #    removed and rewritten in one version, which daily_totals nets out.
    changed = Engine(
        dataclasses.replace(payments_job, transform=_flat_fee), settings, spark, pg_dsn
    )
    restate_windows(changed, [1], request_id="flat")
    window_1 = set(batch_1[:2])
    fee = {pid: 1 for pid, row in expected_outputs(landing).payments.items() if row[6] in window_1}
    assert fee, "window 1 kept no payments"
    truth = _both_oracles(landing, lake, amounts=fee)
    totals.run()
    assert_totals_exact(truth, pg_dsn, "after restating payments window 1")

    # Nothing new, once more.
    before = sorted(actual_totals(pg_dsn))
    assert _changed_windows(totals.run()) == []
    assert sorted(actual_totals(pg_dsn)) == before
    print(f"\nin-process daily_totals scenario: {time.monotonic() - started:.1f}s")


# -- crash matrix: daily_totals's own window, real processes, real SIGKILL ------------------------

# Every point daily_totals passes through; `after_delta` is in the list to show it never fires
# (daily_totals has only a PostgreSQL sink). CI runs its plan (windows are versions of the
# payments table) and the two PostgreSQL points the local payments matrix (test_crash.py) lacks;
# `pg_commit_sent` runs in CI through Spark Connect (test_spark_server.py).
TOTALS_POINTS = (
    "plan",
    "before_sinks",
    "after_delta",
    "after_postgres",
    "before_pg_commit",
    "pg_commit_sent",
    "after_commits",
)
CRASH_WINDOW = 2


def _env(dsn: str, lake: Path, landing: Path, home: Path, fault: str | None = None) -> dict:
    return cli_env(home=home, dsn=dsn, lake=lake, landing=landing, fault=fault)


def _cli(env: dict, home: Path, *args: str) -> Finished:
    return CliRun(list(args), env, home / "logs").finish()


@pytest.mark.slow
@pytest.mark.parametrize(
    "point", points(*TOTALS_POINTS, in_ci=("plan", "after_postgres", "before_pg_commit"))
)
def test_daily_totals_crash_at_fault_point_then_rerun_is_exact(
    spark, point: str, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    # Payments before the crash: committed in-process (the crash under test is daily_totals's).
    generate_payments(landing, records=240, files=3, duplicate_rate=0.1, invalid_rate=0.05, seed=31)
    Engine(get_job("payments"), settings, spark, pg_dsn).run(max_units_per_window=1)
    # One table version per daily_totals window: window 1 is version 0 (the table's creation,
    # no rows), window 2, where the crash is, is version 1 (payments window 1's rows).
    path = str(lake / "payments")
    assert DeltaTable(path).version() >= CRASH_WINDOW
    assert not DeltaTable(path, version=0).file_uris()
    assert DeltaTable(path, version=1).file_uris()

    # 1. daily_totals, one table version per window, a real process killed in window 2.
    crashed = _cli(
        _env(pg_dsn, lake, landing, home, f"{point}@{CRASH_WINDOW}"),
        home,
        "run", "daily_totals", "--max-files-per-window", "1",
    )  # fmt: skip
    fired = f"fault injected at {point} (window {CRASH_WINDOW})" in crashed.stderr
    if point == "after_delta":
        assert crashed.returncode == 0 and not fired, crashed.stderr[-2000:]
    else:
        assert crashed.returncode == -signal.SIGKILL and fired, (
            crashed.returncode,
            crashed.stderr[-2000:],
        )

    # 2. New payments arrive and are committed (in-process: no second JVM start).
    generate_payments(landing, records=150, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=32)
    ops.run("payments", settings, spark=spark, dsn=pg_dsn)

    # 3. Recovery: daily_totals to completion (replays window 2 as recorded, then the rest).
    ops.run("daily_totals", settings, spark=spark, dsn=pg_dsn)

    truth = _both_oracles(landing, lake)
    assert sum(c for _, c in truth.values()) == 390
    diff = assert_totals_exact(truth, pg_dsn, f"crash at {point}@{CRASH_WINDOW}")
    assert diff.lost == diff.doubled == 0


# -- the payments table replaced under daily_totals -----------------------------------------------


def _refill_with_other_rows(path: Path, versions: int) -> None:
    """Delete the payments table and write another in its place: every other payment of the old
    one, some with other amounts, in `versions` commits (so it reaches the versions read)."""
    import pyarrow.compute as pc
    from deltalake import write_deltalake

    old = DeltaTable(str(path)).to_pyarrow_table()
    shutil.rmtree(path)
    kept = old.take(list(range(0, old.num_rows, 2)))
    amounts = pc.multiply(kept.column("amount_cents"), 3)
    kept = kept.set_column(kept.schema.get_field_index("amount_cents"), "amount_cents", amounts)
    size = -(-kept.num_rows // versions)
    for start in range(0, kept.num_rows, size):
        write_deltalake(str(path), kept.slice(start, size), mode="append")
    assert DeltaTable(str(path)).version() == versions - 1


@pytest.mark.parametrize("how", ["recreated", "restored"])
def test_a_replaced_payments_table_is_refused_and_restated_exactly(
    spark, how: str, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    from onceflow.errors import SinkStateError, SourceError

    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    payments = Engine(get_job("payments"), settings, spark, pg_dsn)
    totals = Engine(get_job("daily_totals"), settings, spark, pg_dsn)
    path = lake / "payments"

    # daily_totals reads the payments table in two runs; a copy is taken between them.
    generate_payments(landing, records=240, files=3, duplicate_rate=0.1, invalid_rate=0.05, seed=41)
    payments.run(max_units_per_window=1)
    totals.run(max_units_per_window=2)
    shutil.copytree(path, tmp_path / "payments-copy")
    generate_payments(landing, records=160, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=42)
    payments.run(max_units_per_window=1)
    totals.run(max_units_per_window=2)
    assert_totals_exact(_both_oracles(landing, lake), pg_dsn, "before the table is replaced")
    read_through = DeltaTable(str(path)).version()

    if how == "recreated":
        _refill_with_other_rows(path, read_through + 3)
    else:
        # Restored from the older copy; payments puts its later windows back (new versions
        # with the old numbers), then more payments are committed on top.
        shutil.rmtree(path)
        shutil.copytree(tmp_path / "payments-copy", path)
        with pytest.raises(SinkStateError, match="onceflow reconcile payments"):
            payments.run()
        reconcile(payments)
        generate_payments(landing, records=80, files=1, invalid_rate=0.05, seed=43)
        payments.run()
        assert DeltaTable(str(path)).version() > read_through
    truth = totals_from_delta(lake)
    if how == "restored":
        assert truth == _both_oracles(landing, lake)

    # daily_totals refuses: reading on after the versions it read would skip or repeat them.
    before = sorted(actual_totals(pg_dsn))
    with pytest.raises(SourceError) as refused:
        totals.run()
    message = str(refused.value)
    assert "Delta table `payments`" in message and f"version {read_through}" in message, message
    assert "`onceflow restate <job> --source-replaced`" in message, message
    assert sorted(actual_totals(pg_dsn)) == before

    # The recovery it names, then a run: exact against the new table. By the real command
    # once (its output is the property); in-process on the session's Spark otherwise.
    if how == "restored":
        restated = _cli(_env(pg_dsn, lake, landing, home), home, "restate", "daily_totals",
                        "--source-replaced")  # fmt: skip
        assert restated.returncode == 0, restated.stderr[-3000:]
        assert "restated in every sink" in restated.stdout, restated.stdout
    else:
        result = ops.restate("daily_totals", [], settings, spark=spark, dsn=pg_dsn,
                             source_replaced=True)  # fmt: skip
        assert result.committed, result.as_json()
    Engine(get_job("daily_totals"), settings, spark, pg_dsn).run()
    diff = assert_totals_exact(truth, pg_dsn, f"after the table was {how} and restated")
    assert diff.lost == diff.doubled == 0
    # Nothing left to restate; a run with nothing new changes nothing.
    totals = Engine(get_job("daily_totals"), settings, spark, pg_dsn)
    assert restate_windows(totals, [], source_replaced=True) == []
    assert _changed_windows(totals.run()) == []
    assert_totals_exact(truth, pg_dsn, "after a run with nothing new")
