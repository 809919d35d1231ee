"""The freshness check fails while input older than the job's bound waits unplanned, and passes
once a run has taken it; the recovery job (and so the hourly reconcile) evaluates it too. A
committed file that changed is a warning of the check."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pytest
from dagster import AssetCheckSeverity, AssetSelection, DagsterInstance, RunConfig, materialize

from assets import WindowRunConfig, build_job_assets
from assets.checks import FRESHNESS_CHECK
from onceflow.generate import generate_payments
from onceflow.registry import get_job
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from tests.support.cli import ONCEFLOW, RUN_TIMEOUT_S, cli_env
from tests.support.oracle import expected_outputs
from tests.support.orders_data import USER_PROJECT, user_project_on_path, write_orders
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.dagster


def _freshness_results(result) -> dict[str, tuple[bool, dict]]:
    return {
        e.asset_key.to_user_string(): (e.passed, {k: v.value for k, v in e.metadata.items()})
        for e in result.get_asset_check_evaluations()
        if e.check_name == FRESHNESS_CHECK
    }


def test_stale_unplanned_input_fails_the_check_until_a_run_takes_it(
    resources: dict, pg_dsn: str, lake: Path, landing: Path
) -> None:
    job = dataclasses.replace(get_job("payments"), freshness_s=600)
    defs = build_job_assets(job)
    generate_payments(landing, records=400, files=2, seed=4)
    old = time.time() - 3600
    for path in (landing / "payments").iterdir():
        os.utime(path, (old, old))
    checks = AssetSelection.checks(*[k for c in defs.checks for k in c.check_keys])
    freshness = AssetSelection.checks(
        *[k for c in defs.checks for k in c.check_keys if k.name == FRESHNESS_CHECK]
    )
    everything = [*defs.assets, *defs.checks]
    with DagsterInstance.ephemeral() as instance:
        stale = materialize(everything, resources=resources, instance=instance, selection=freshness)
        found = _freshness_results(stale)
        assert set(found) == {s.name for s in job.sinks}
        for passed, metadata in found.values():
            assert not passed
            assert metadata["unplanned_units"] == 2
            assert metadata["oldest_unplanned_age_s"] >= 3000

        ran = materialize(
            everything,
            resources=resources,
            instance=instance,
            selection=AssetSelection.assets(*[s.name for s in job.sinks]) | checks,
            run_config=RunConfig({"payments_run": WindowRunConfig()}),
        )
        assert ran.success
        assert all(passed for passed, _ in _freshness_results(ran).values())
        assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_the_recovery_job_evaluates_the_freshness_check() -> None:
    import definitions

    recovery = definitions.defs.resolve_job_def("payments_recovery_job")
    keys = recovery.asset_layer.asset_graph.asset_check_keys
    assert {k.asset_key.to_user_string() for k in keys if k.name == FRESHNESS_CHECK} == {
        "lake_payments",
        "pg_payments",
        "pg_merchant_balances",
        "pg_quarantine",
    }


def test_a_committed_file_that_changed_is_a_warning_of_the_check(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    """The README's `orders` job, run by the real command in its project folder; a row is then
    appended to its committed file. The check warns (never fails the run), naming the file."""
    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    write_orders(landing, ["orders-001.csv"])
    run = subprocess.run(
        [ONCEFLOW, "run", "orders"], env=env, cwd=USER_PROJECT, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with (landing / "orders" / "orders-001.csv").open("a") as handle:
        handle.write("o10,Judy,500,2024-05-04T10:00:00Z\n")

    with user_project_on_path() as user:
        defs = build_job_assets(user.ORDERS)
    freshness = AssetSelection.checks(
        *[k for c in defs.checks for k in c.check_keys if k.name == FRESHNESS_CHECK]
    )
    resources = {  # no Spark is started: the check reads the ledger and lists the folder
        "spark": SparkResource(),
        "postgres": PostgresResource(dsn=pg_dsn),
        "onceflow": OnceflowSettingsResource(home=str(home), lake=str(lake), landing=str(landing)),
    }
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [*defs.assets, *defs.checks], resources=resources, instance=instance,
            selection=freshness,
        )  # fmt: skip
    assert result.success
    found = [e for e in result.get_asset_check_evaluations() if e.check_name == FRESHNESS_CHECK]
    assert {e.asset_key.to_user_string() for e in found} == {"pg_orders", "orders_quarantine"}
    for evaluation in found:
        assert not evaluation.passed
        assert evaluation.severity == AssetCheckSeverity.WARN
        assert "orders/orders-001.csv (window 1): now " in (evaluation.description or "")
        assert "Judy" not in (evaluation.description or "")
        metadata = {k: v.value for k, v in evaluation.metadata.items()}
        assert metadata["changed_units"] == 1 and metadata["unplanned_units"] == 0
        assert metadata["changed"][0]["unit"] == "orders/orders-001.csv"
