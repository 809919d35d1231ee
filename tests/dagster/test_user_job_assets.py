"""A user's job (tests/support/user_project) in Dagster: its assets come from the factory, run
for real, and sit next to the reference jobs in one set of definitions with lineage between
jobs. Nothing in onceflow, assets/ or definitions.py names the user's job."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterInstance, Definitions, RunConfig, materialize

import definitions
from assets import RecoveryConfig, WindowRunConfig, build_job_assets
from onceflow.job import Job
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from tests.support.orders_data import (
    USER_PROJECT,
    assert_orders_exact,
    one_file_per_window,
    user_project_on_path,
    write_orders,
)

pytestmark = pytest.mark.dagster

ORDERS_SINKS = ["pg_orders", "orders_quarantine"]
PAYMENTS_SINKS = ["lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine"]


@pytest.fixture()
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture()
def orders_job() -> Iterator[Job]:
    with user_project_on_path() as user:
        yield user.ORDERS


def _materialisations(result: Any, node: str) -> dict[str, Any]:
    return {m.asset_key.to_user_string(): m for m in result.asset_materializations_for_node(node)}


def _value(mat: Any, key: str) -> Any:
    return mat.metadata[key].value


def test_user_job_materialises_exactly(
    orders_job: Job, resources: dict, instance: DagsterInstance, pg_dsn: str, landing: Path
) -> None:
    built = build_job_assets(orders_job)
    source, sinks, recovery = built.assets
    assert source.key == AssetKey("orders_landing")
    assert {k.to_user_string() for k in sinks.keys} == set(ORDERS_SINKS)
    assert {j.name for j in built.jobs} == {
        "orders_job",
        "orders_recovery_job",
        "orders_follow_job",
        "orders_maintenance_job",  # its ledger detail: every job has some
    }

    write_orders(landing)
    result = materialize(
        [source, sinks],
        resources=resources,
        instance=instance,
        run_config=RunConfig({"orders_run": WindowRunConfig(max_files_per_window=1)}),
    )
    assert result.success
    mats = _materialisations(result, "orders_run")
    assert set(mats) == set(ORDERS_SINKS)
    for mat in mats.values():
        assert _value(mat, "windows") == "1-3"
        assert _value(mat, "windows_committed") == 3
        assert _value(mat, "rows_kept") == 6
        assert _value(mat, "quarantined") == 4
        assert _value(mat, "transaction_id")
    assert _value(mats["pg_orders"], "rows_written") == 6  # o2 twice: inserted, then updated
    assert _value(mats["orders_quarantine"], "rows_written") == 4
    assert_orders_exact(pg_dsn, one_file_per_window())

    # A backfill with restatement from the UI's run config replaces windows 1-2; the later
    # update of o2 (window 3) still wins.
    restated = materialize(
        [source, sinks],
        resources=resources,
        instance=instance,
        run_config=RunConfig({"orders_run": WindowRunConfig(windows="1-2", restate=True)}),
    )
    assert restated.success
    for mat in _materialisations(restated, "orders_run").values():
        assert _value(mat, "mode") == "restate"
        assert _value(mat, "windows") == "1-2"
    assert_orders_exact(pg_dsn, one_file_per_window())

    # The job's recovery asset, reconciling every window: nothing to replay, nothing differs.
    recovered = materialize(
        [recovery],
        resources=resources,
        instance=instance,
        run_config=RunConfig({"orders_recovery": RecoveryConfig(reconcile="full")}),
    )
    assert recovered.success
    (mat,) = recovered.asset_materializations_for_node("orders_recovery")
    assert _value(mat, "windows_replayed") == 0
    assert _value(mat, "windows_incomplete") == 0
    assert _value(mat, "reconcile_clean") is True
    for sink in ORDERS_SINKS:
        assert (_value(mat, f"{sink}.missing"), _value(mat, f"{sink}.extra")) == (0, 0)
        assert _value(mat, f"{sink}.changed") == 0
    (check,) = recovered.get_asset_check_evaluations()
    assert check.passed
    assert_orders_exact(pg_dsn, one_file_per_window())


def _resources(tmp_path: Path) -> dict[str, Any]:
    """Resources that connect to nothing until a run uses them."""
    return {
        "spark": SparkResource(),
        "postgres": PostgresResource(dsn="postgresql://nobody@localhost:1/none"),
        "onceflow": OnceflowSettingsResource(
            home=str(tmp_path / "home"), lake=str(tmp_path / "lake"), landing=str(tmp_path)
        ),
    }


@pytest.fixture()
def jobs_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """ONCEFLOW_JOBS may name the user's module; its folder is on the path as PYTHONPATH puts
    it, and both are gone afterwards."""
    monkeypatch.setattr(sys, "path", [str(USER_PROJECT), *sys.path])
    loaded = "orders_jobs" in sys.modules
    yield monkeypatch
    if not loaded:
        sys.modules.pop("orders_jobs", None)


def test_definitions_hold_user_and_reference_jobs_with_lineage(
    jobs_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jobs_env.setenv(
        "ONCEFLOW_JOBS", "orders_jobs,onceflow.jobs.payments,onceflow.jobs.daily_totals"
    )
    defs = definitions.build_defs(_resources(tmp_path))
    Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {
        "orders_landing",
        *ORDERS_SINKS,
        "orders_recovery",
        "payments_landing",
        *PAYMENTS_SINKS,
        "payments_recovery",
        "pg_daily_totals",
        "daily_totals_recovery",
    }
    for sink in ORDERS_SINKS:
        node = graph.get(AssetKey(sink))
        assert node.parent_keys == {AssetKey("orders_landing")}
        assert node.group_name == "orders"
    assert graph.get(AssetKey("orders_recovery")).parent_keys == {AssetKey(s) for s in ORDERS_SINKS}
    for sink in PAYMENTS_SINKS:
        assert graph.get(AssetKey(sink)).parent_keys == {AssetKey("payments_landing")}
    # Lineage between jobs: daily_totals reads the Delta table payments' lake sink writes.
    assert graph.get(AssetKey("pg_daily_totals")).parent_keys == {AssetKey("lake_payments")}
    assert AssetKey("pg_daily_totals") in graph.get(AssetKey("lake_payments")).child_keys
    assert "daily_totals_delta" not in keys  # no separate source asset when a job writes it

    for job in ("orders", "payments", "daily_totals"):
        for name in (f"{job}_job", f"{job}_recovery_job"):
            assert repo.get_job(name).tags["onceflow/job"] == job
    assert {s.name for s in repo.sensor_defs} == {
        f"{job}_{kind}_sensor"
        for job in ("orders", "payments", "daily_totals")
        for kind in ("new_data", "failure", "quality")
    }
    assert "orders_reconcile_schedule" in {s.name for s in repo.schedule_defs}
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert {(s, "quality") for s in ORDERS_SINKS} <= checks
    assert ("orders_recovery", "all_windows_committed") in checks
    # The orders job's run commits both its sinks in one op.
    run = defs.get_assets_def(AssetKey("pg_orders"))
    assert set(run.keys) == {AssetKey(s) for s in ORDERS_SINKS}


def test_definitions_follow_onceflow_jobs(jobs_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    jobs_env.setenv("ONCEFLOW_JOBS", "orders_jobs")
    graph = definitions.build_defs(_resources(tmp_path)).get_repository_def().asset_graph
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {
        "orders_landing",
        *ORDERS_SINKS,
        "orders_recovery",
    }
