"""`daily_totals` stays exact while `payments`' Delta table is compacted, checkpointed, vacuumed
and its log cleaned between and during payments windows; a restatement and a reconcile after
maintenance are exact too.

In-process: maintenance in a thread racing a payments run, between daily_totals windows, with
the table's retentions at zero so only onceflow's horizon keeps anything. Slow: real
`onceflow run payments` and `onceflow maintain payments` processes, maintenance killed with
SIGKILL at random moments.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from onceflow import ops
from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.reconcile import format_report, reconcile
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from onceflow.sinks.delta._log import data_files, relative
from onceflow.storage import Location
from tests.core.test_daily_totals import _both_oracles, _flat_fee
from tests.support.cli import CliRun, cli_env
from tests.support.daily_totals_oracle import assert_totals_exact
from tests.support.oracle import expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact


def _zero_retention(lake: Path) -> None:
    DeltaTable(str(lake / "payments")).alter.set_table_properties(
        {
            "delta.deletedFileRetentionDuration": "interval 0 seconds",
            "delta.logRetentionDuration": "interval 0 seconds",
        }
    )


def _kept_files_on_disk(lake: Path, keep: int) -> None:
    """Every file any version from `keep` on holds is on disk (each version loaded)."""
    path = lake / "payments"
    table = Location.parse(str(path))
    on_disk = {rel for rel, _, _ in data_files(table)}
    for version in range(max(keep, 0), DeltaTable(str(path)).version() + 1):
        snapshot = DeltaTable(str(path), version=version)
        for file in snapshot.get_add_actions(flatten=True).column("path").to_pylist():
            assert relative(table, file) in on_disk, (version, file)


def _folded_plans(dsn: str, job: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM onceflow.windows WHERE job = %s AND offsets IS NULL", (job,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_daily_totals_exact_while_payments_is_maintained(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    settings.check_folders()
    payments_job, totals_job = get_job("payments"), get_job("daily_totals")
    jobs = [payments_job, totals_job]
    payments = Engine(payments_job, settings, spark, pg_dsn)
    totals = Engine(totals_job, settings, spark, pg_dsn)

    def maintain(**kw: object) -> ops.MaintainResult:
        return ops.maintain(payments_job, settings, dsn=pg_dsn, jobs=jobs, **kw)

    # 1. Four payments windows, then daily_totals reads them all.
    generate_payments(landing, records=300, files=4, duplicate_rate=0.1, invalid_rate=0.05, seed=41)
    batch_1 = visible_files(landing)
    payments.run(max_units_per_window=1)
    _zero_retention(lake)
    totals.run(max_units_per_window=1)
    assert_totals_exact(_both_oracles(landing, lake), pg_dsn, "first batch")

    # 2. More payments, committed while maintenance runs again and again in a thread.
    generate_payments(landing, records=200, files=4, duplicate_rate=0.1, invalid_rate=0.05, seed=42)
    stop = threading.Event()
    results: list[ops.MaintainResult] = []
    errors: list[BaseException] = []

    def keep_maintaining() -> None:
        while not stop.is_set():
            try:
                results.append(maintain(orphan_age_s=600))
            except Exception as exc:
                errors.append(exc)
            time.sleep(0.2)

    thread = threading.Thread(target=keep_maintaining)
    thread.start()
    try:
        payments.run(max_units_per_window=1)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert results and any(t.compacted_files for r in results for t in r.tables)

    # daily_totals lags: vacuum keeps what it has not read, and says so.
    lagging = maintain(orphan_age_s=0)
    (table,) = lagging.tables
    assert [h.job for h in table.binding] == ["daily_totals"], lagging.lines()
    _kept_files_on_disk(lake, table.keep_version)

    # 3. daily_totals reads on, one version per window, with maintenance between its windows:
    #    payments' tables vacuumed past what daily_totals read, and daily_totals' own windows
    #    folded past its detail horizon as they complete (its plans, which that horizon reads).
    def maintain_both(_: object) -> None:
        maintain(orphan_age_s=0)
        ops.maintain(totals_job, settings, dsn=pg_dsn, jobs=jobs, keep_detail_days=0)

    totals.run(max_units_per_window=1, on_window=maintain_both)
    assert _folded_plans(pg_dsn, "daily_totals") > 0
    truth = _both_oracles(landing, lake)
    assert sum(c for _, c in truth.values()) == 500
    assert_totals_exact(truth, pg_dsn, "second batch, maintained between windows")

    # Caught up: everything past the newest version goes, and the log below its checkpoint.
    caught_up = maintain(orphan_age_s=0)
    (table,) = caught_up.tables
    assert table.binding == () and table.files_after == table.live_files_after
    assert (
        table.log_entries_removed > 0
        or not (lake / "payments/_delta_log").joinpath(f"{0:020d}.json").exists()
    )
    _kept_files_on_disk(lake, table.keep_version)

    # 4. A restatement of payments window 1 after compaction and vacuum: daily_totals exact.
    changed = Engine(
        dataclasses.replace(payments_job, transform=_flat_fee), settings, spark, pg_dsn
    )
    restate_windows(changed, [1], request_id="flat")
    window_1 = set(batch_1[:1])
    fee = {pid: 1 for pid, row in expected_outputs(landing).payments.items() if row[6] in window_1}
    assert fee
    truth = _both_oracles(landing, lake, amounts=fee)
    totals.run()
    assert_totals_exact(truth, pg_dsn, "after restating payments window 1")
    maintain(orphan_age_s=0)

    # 5. Reconcile after compaction and vacuum: payments' sinks hold exactly their windows
    #    (nothing to repair), and daily_totals stays exact.
    payments_back = Engine(payments_job, settings, spark, pg_dsn)
    restate_windows(payments_back, [1], request_id="back")
    totals.run()
    maintain(orphan_age_s=0)
    report = reconcile(payments_back)
    assert all(s.clean for s in report.sinks), format_report(report)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    reconcile(totals)
    assert_totals_exact(_both_oracles(landing, lake), pg_dsn, "after reconcile")


@pytest.mark.slow
@pytest.mark.exhaustive  # make test-all: the chain test above races maintenance in CI
def test_maintenance_killed_at_random_while_payments_runs(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=200, files=2, seed=51)
    Engine(get_job("payments"), settings, spark, pg_dsn).run(max_units_per_window=1)
    _zero_retention(lake)
    generate_payments(landing, records=300, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=52)

    rng = random.Random(53)
    run = CliRun(["run", "payments", "--max-files-per-window", "1"], env, home / "logs")
    killed = finished = 0
    attempt = 0
    took = 3.0  # how long the last maintenance that finished took
    while run.proc.poll() is None:
        started = time.monotonic()
        maintain = CliRun(
            ["maintain", "payments", "--orphan-age-s", "0", "--keep-detail-days", "0"],
            env,
            home / "logs",
        )
        # Every other maintenance process is killed at a random point of what one takes
        # (start-up, compaction, vacuum, log cleanup, the ledger's detail dropped and its
        # markers and plans folded); the others finish.
        if attempt % 2 == 1:
            time.sleep(rng.uniform(0.3, 0.95) * took)
            if maintain.proc.poll() is None:
                maintain.kill_group()
                killed += 1
        outcome = maintain.finish()
        if attempt % 2 == 0:
            took = time.monotonic() - started
        finished += outcome.returncode == 0
        attempt += 1
    first = run.finish()
    # A maintenance that removed orphans fenced the run (exit 3): the next run finishes.
    assert first.returncode in (0, 3), first.stderr[-2000:]
    again = CliRun(["run", "payments"], env, home / "logs").finish()
    assert again.returncode == 0, again.stderr[-2000:]
    done = CliRun(
        ["maintain", "payments", "--orphan-age-s", "0", "--keep-detail-days", "0"],
        env,
        home / "logs",
    ).finish()
    assert done.returncode == 0, done.stderr[-2000:]
    totals = CliRun(["run", "daily_totals"], env, home / "logs").finish()
    assert totals.returncode == 0, totals.stderr[-2000:]

    assert _folded_plans(pg_dsn, "payments") == 8  # every window, folded by the last one
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    report = reconcile(Engine(get_job("payments"), settings, spark, pg_dsn))
    assert all(s.clean for s in report.sinks), format_report(report)
    diff = assert_totals_exact(_both_oracles(landing, lake), pg_dsn, "maintenance killed")
    assert diff.lost == diff.doubled == 0
    print(f"maintenance processes killed: {killed}, finished: {finished}")
    assert killed and finished, (killed, finished)
