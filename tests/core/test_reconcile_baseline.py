"""An accumulating sink's verified state (`sinks/postgres/_baseline.py`): an incremental reconcile
compares the table whole against it plus the windows after it, and never against a state the
platform changed since (a restatement, a window committed again below it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import psycopg

from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.reconcile import ReconcileReport, format_report, reconcile
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from tests.support.flat_fee_payments import FLAT_FEE
from tests.support.oracle import Expected, expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact


def _flat_fee(expected: Expected) -> Expected:
    """The oracle with every payment at one cent, balances summed again."""
    payments = {pid: (*row[:3], 1, *row[4:]) for pid, row in expected.payments.items()}
    balances: dict[tuple[str, str], tuple[int, int]] = {}
    for row in payments.values():
        total, count = balances.get((row[1], row[4]), (0, 0))
        balances[(row[1], row[4])] = (total + row[3], count + 1)
    return dataclasses.replace(expected, payments=payments, balances=balances)


def _balances(report: ReconcileReport) -> tuple[int, int, int]:
    [diff] = [s for s in report.sinks if s.sink == "pg_merchant_balances"]
    return diff.missing, diff.extra, diff.changed


def test_incremental_reconcile_never_compares_with_a_state_changed_since(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=900, files=4, duplicate_rate=0.1, invalid_rate=0.05, seed=3)
    files = visible_files(landing)
    engine = Engine(get_job("payments"), settings, spark, pg_dsn)
    engine.run(max_units_per_window=2)  # windows 1, 2
    assert reconcile(engine).clean  # the balances' state through window 2 is kept
    steady = reconcile(engine, dry_run=True, mode="incremental")
    assert steady.clean and steady.windows_recomputed == 0, format_report(steady)

    # Every window restated with a new transform: the balances the state was kept of change.
    changed = Engine(FLAT_FEE, settings, spark, pg_dsn)
    restate_windows(changed, [1, 2], request_id="flat")
    after = reconcile(changed, mode="incremental")
    # Compared against the old state, the restatement would look like damage and be undone.
    assert after.clean, format_report(after)
    assert (after.recomputed_after, after.windows_recomputed) == (0, 2)
    expected = _flat_fee(expected_outputs(landing, windows=[files[:2], files[2:]]))
    assert_exact(expected, actual_outputs(pg_dsn, lake))
    # The state kept by that reconcile holds from then on.
    assert reconcile(changed, dry_run=True, mode="incremental").windows_recomputed == 0

    # A sink that lost a window below the kept state (its marker and its sums gone): the state
    # is not used while the window is missing, and once reconcile has replayed it, the table
    # is compared whole against the kept state again.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE merchant_balances b SET total_cents = b.total_cents - c.a[1],"
            " payment_count = b.payment_count - c.a[2]"
            " FROM (SELECT k.merchant_id, k.currency, array[k.total::bigint, k.n::bigint] AS a"
            "       FROM onceflow.window_contributions w,"
            "       unnest(w.keys[1:1], w.keys[2:2], w.amounts[1:1], w.amounts[2:2])"
            "         AS k(merchant_id, currency, total, n)"
            "       WHERE w.job = 'payments' AND w.sink = 'pg_merchant_balances'"
            "       AND w.window_id = 2) c"
            " WHERE (b.merchant_id, b.currency) = (c.merchant_id, c.currency)"
        )
        conn.execute(
            "DELETE FROM onceflow.sink_commits WHERE job = 'payments'"
            " AND sink = 'pg_merchant_balances' AND window_id = 2"
        )
    balances = changed.group_of["pg_merchant_balances"]
    assert balances.reconcile_since("pg_merchant_balances", 2) == 0
    again = reconcile(changed, mode="incremental")
    assert again.replayed == {"pg_merchant_balances": [2]}, format_report(again)
    assert (again.recomputed_after, again.windows_recomputed) == (2, 0), format_report(again)
    assert again.clean and _balances(again) == (0, 0, 0), format_report(again)
    assert_exact(expected, actual_outputs(pg_dsn, lake))
