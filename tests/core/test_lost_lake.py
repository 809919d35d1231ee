"""A lake deleted, or replaced by an older copy: the run refuses before computing anything,
reconcile replays what the Delta sink lacks, and the next run is exact; PostgreSQL stays
consistent at every step."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from onceflow.engine import Engine
from onceflow.errors import SinkStateError
from onceflow.generate import generate_payments
from onceflow.reconcile import reconcile
from onceflow.registry import get_job
from onceflow.settings import Settings
from tests.support.oracle import expected_outputs
from tests.support.outputs import Actual, actual_outputs, assert_exact, diff_outputs


class Landing:
    """Input generated once, landed a few files at a time."""

    def __init__(self, tmp_path: Path, landing: Path) -> None:
        source = tmp_path / "input"
        generate_payments(
            source, records=2400, files=8, duplicate_rate=0.25, invalid_rate=0.05, seed=11
        )
        self.files = sorted((source / "payments").iterdir())
        self.root = landing
        (landing / "payments").mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_path

    def land(self, count: int) -> None:
        for path in self.files[:count]:
            target = self.root / "payments" / path.name
            if not target.exists():
                shutil.copy2(path, target)

    def expected_for(self, count: int):
        """The oracle over the first `count` files only."""
        partial = self.tmp / f"partial-{count}"
        (partial / "payments").mkdir(parents=True, exist_ok=True)
        for path in self.files[:count]:
            shutil.copy2(path, partial / "payments" / path.name)
        return expected_outputs(partial)


def assert_postgres_consistent(actual: Actual) -> None:
    """No payment twice, and every balance the sum of its payments."""
    ids = [row[0] for row in actual.pg_payments]
    assert len(ids) == len(set(ids)), "a payment is in PostgreSQL twice"
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for row in actual.pg_payments:
        sums[(row[1], row[4])][0] += row[3]
        sums[(row[1], row[4])][1] += 1
    balances = {(m, c): [t, n] for m, c, t, n in actual.balances}
    assert balances == dict(sums), "a balance differs from the sum of its payments"


@pytest.mark.parametrize("damage", ["deleted", "older_copy"])
def test_lost_lake_is_refused_then_reconcile_replays_it_and_runs_go_on(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, damage: str
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)

    def engine() -> Engine:
        return Engine(job, settings, spark, pg_dsn)

    data.land(2)
    engine().run(max_units_per_window=2)
    backup = tmp_path / "lake-backup"
    shutil.copytree(lake, backup)
    data.land(4)
    engine().run(max_units_per_window=2)
    assert_exact(data.expected_for(4), actual_outputs(pg_dsn, lake))

    shutil.rmtree(lake)
    if damage == "older_copy":
        shutil.copytree(backup, lake)  # holds window 1 only
    else:
        lake.mkdir()
    data.land(6)  # new input, whose duplicates of earlier payments need the lost dedupe state

    with pytest.raises(SinkStateError) as refused:
        engine().run(max_units_per_window=2)
    lacking = "1-2" if damage == "deleted" else "2"
    assert f"lake_payments lacks windows {lacking}" in refused.value.message
    assert f"onceflow reconcile {job.name}" in refused.value.message
    during = actual_outputs(pg_dsn, lake)
    assert_postgres_consistent(during)
    pg_only = diff_outputs(data.expected_for(4), during)
    assert pg_only["pg payments"].exact and pg_only["merchant_balances"].exact
    assert engine().lacking_windows() == {"lake_payments": [1, 2] if damage == "deleted" else [2]}

    report = reconcile(engine())
    assert report.replayed == {"lake_payments": [1, 2] if damage == "deleted" else [2]}
    assert report.lacking == {}
    assert report.clean, report
    assert engine().lacking_windows() == {}
    assert_postgres_consistent(actual_outputs(pg_dsn, lake))

    result = engine().run(max_units_per_window=2)
    assert [w.window_id for w in result.windows] == [3]
    assert_exact(data.expected_for(6), actual_outputs(pg_dsn, lake))


def test_dry_run_reports_what_the_lake_lacks_and_changes_nothing(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(4)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    shutil.rmtree(lake)
    lake.mkdir()

    report = reconcile(Engine(job, settings, spark, pg_dsn), dry_run=True)
    assert report.lacking == {"lake_payments": [1, 2]}
    assert not report.clean
    assert actual_outputs(pg_dsn, lake).delta_payments == []
    assert Engine(job, settings, spark, pg_dsn).lacking_windows() == {"lake_payments": [1, 2]}


def test_recovery_puts_back_what_the_lake_lost(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(4)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    shutil.rmtree(lake)
    lake.mkdir()
    data.land(8)

    recovered = Engine(job, settings, spark, pg_dsn).recover("recovery-1")
    assert recovered.restored == {"lake_payments": [1, 2]}
    assert [w.window_id for w in recovered.run.windows] == [3]
    assert_exact(data.expected_for(8), actual_outputs(pg_dsn, lake))
