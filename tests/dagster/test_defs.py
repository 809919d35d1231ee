"""The definitions load, validate, and hold the assets, lineage, checks, jobs and sensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dagster import AssetKey

import definitions

ROOT = Path(__file__).resolve().parents[2]
SINKS = ["lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine"]


def _repo():
    return definitions.defs.get_repository_def()


def test_definitions_import_from_repo_root() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import definitions"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_definitions_validate() -> None:
    from dagster import Definitions

    Definitions.validate_loadable(definitions.defs)


def test_asset_keys_and_lineage() -> None:
    graph = _repo().asset_graph
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {
        "payments_landing",
        *SINKS,
        "payments_recovery",
        "pg_daily_totals",
        "daily_totals_recovery",
    }
    for sink in SINKS:
        assert graph.get(AssetKey(sink)).parent_keys == {AssetKey("payments_landing")}
    assert graph.get(AssetKey("payments_recovery")).parent_keys == {AssetKey(s) for s in SINKS}
    # One job feeds the next: daily_totals reads the payments Delta table.
    assert graph.get(AssetKey("pg_daily_totals")).parent_keys == {AssetKey("lake_payments")}
    # One engine run commits every sink: the sink assets share one op and cannot be split.
    run = definitions.defs.get_assets_def(AssetKey("pg_payments"))
    assert set(run.keys) == {AssetKey(s) for s in SINKS}
    assert not run.can_subset


def test_jobs_tags_sensors_schedule_checks() -> None:
    repo = _repo()
    for job in ("payments", "daily_totals"):
        for name in (f"{job}_job", f"{job}_recovery_job"):
            assert repo.get_job(name).tags["onceflow/job"] == job
    assert {s.name for s in repo.sensor_defs} == {
        f"{job}_{kind}_sensor"
        for job in ("payments", "daily_totals")
        for kind in ("new_data", "failure", "quality")
    }
    assert {s.name for s in repo.schedule_defs} == {
        "payments_reconcile_schedule",
        "daily_totals_reconcile_schedule",
        "payments_maintenance_schedule",
        "daily_totals_maintenance_schedule",  # its ledger detail, though it has no Delta sink
    }
    checks = {(k.asset_key.to_user_string(), k.name) for k in repo.asset_graph.asset_check_keys}
    assert {(s, "quality") for s in SINKS} <= checks
    assert ("payments_recovery", "all_windows_committed") in checks


def test_window_specs() -> None:
    import pytest

    from onceflow.errors import ConfigurationError
    from onceflow.windows import format_windows, parse_windows

    assert parse_windows("3-7") == [3, 4, 5, 6, 7]
    assert parse_windows("3,5, 9-10") == [3, 5, 9, 10]
    assert format_windows([1, 2, 3, 5, 9, 10]) == "1-3,5,9-10"
    for bad in ("", "0", "7-3", "a", "1-100000"):
        with pytest.raises(ConfigurationError):
            parse_windows(bad)


def test_instance_config_limits_one_run_and_one_op_per_job(tmp_path) -> None:
    import shutil

    from dagster import DagsterInstance

    shutil.copy(Path(__file__).parents[2] / "dagster.yaml", tmp_path / "dagster.yaml")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        config = instance.get_concurrency_config()
        assert config.pool_config.default_pool_limit == 1
        assert {
            "key": "onceflow/job",
            "value": {"applyLimitPerUniqueValue": True},
            "limit": 1,
        } in config.run_queue_config.tag_concurrency_limits
        assert instance.run_retries_enabled
        # A killed run worker's pool slot is freed, or the job's later runs wait for ever.
        monitoring = instance.run_monitoring_settings
        assert monitoring["enabled"]
        assert 0 < monitoring["free_slots_after_run_end_seconds"] <= 60
    repo = _repo()
    for job, op in (
        ("payments_job", "payments_run"),
        ("payments_recovery_job", "payments_recovery"),
    ):
        pools = {n.name: n.definition.pool for n in repo.get_job(job).nodes_in_topological_order}
        assert pools[op] == "onceflow_payments"


def test_sink_assets_carry_freshness_policy_columns_and_retry_policy() -> None:
    from datetime import timedelta

    from dagster import Backoff, TableSchema

    from assets.runs import TRANSIENT_RETRY_POLICY
    from onceflow.registry import get_job

    payments = get_job("payments")
    run = definitions.defs.get_assets_def(AssetKey("pg_payments"))
    for spec in run.specs:
        policy = spec.freshness_policy
        assert policy is not None, spec.key
        assert policy.fail_window.to_timedelta() == timedelta(seconds=payments.freshness_s)
    pg = next(s for s in run.specs if s.key == AssetKey("pg_payments"))
    schema = pg.metadata["dagster/column_schema"]
    assert isinstance(schema, TableSchema)
    assert [c.name for c in schema.columns] == list(payments.sink("pg_payments").columns)
    # A Delta sink's columns follow the transform: known from its first materialisation on.
    lake = next(s for s in run.specs if s.key == AssetKey("lake_payments"))
    assert "dagster/column_schema" not in lake.metadata
    for key in ("pg_payments", "payments_recovery"):
        policy = definitions.defs.get_assets_def(AssetKey(key)).op.retry_policy
        assert policy == TRANSIENT_RETRY_POLICY and policy.backoff is Backoff.EXPONENTIAL
