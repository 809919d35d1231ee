"""Sink assets name their tables (`dagster/table_name`, never credentials), and the quality check
of the table a downstream job reads is blocking: a failed check keeps daily_totals from
materialising in the same run."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    AssetSelection,
    DagsterInstance,
    materialize,
)
from deltalake import DeltaTable, write_deltalake

import definitions
from assets import build_job_assets
from assets.factory import lake_tables
from onceflow.generate import generate_payments
from onceflow.registry import load_jobs

TABLES = {
    "lake_payments": "payments",
    "pg_payments": "public.payments",
    "pg_merchant_balances": "public.merchant_balances",
    "pg_quarantine": "onceflow.quarantine",
    "pg_daily_totals": "public.daily_totals",
}
GATE = AssetCheckKey(AssetKey("lake_payments"), "quality")
SECRET = "s3cret-pw"


def _specs(defs) -> dict[str, object]:
    graph = defs.get_repository_def().asset_graph
    return {k.to_user_string(): graph.get(k) for k in graph.get_all_asset_keys()}


def test_sink_assets_carry_their_table_name_and_no_credentials(monkeypatch) -> None:
    # A DSN with a password in the environment: the names come from the jobs, not from it.
    monkeypatch.setenv("ONCEFLOW_POSTGRES_DSN", f"postgresql://onceflow:{SECRET}@db.internal/x")
    defs = definitions.build_defs()
    nodes = _specs(defs)
    for key, name in TABLES.items():
        assert nodes[key].metadata["dagster/table_name"] == name, key
    for node in nodes.values():
        text = repr(dict(node.metadata))
        assert SECRET not in text and "postgresql://" not in text and "@" not in text


def test_only_the_quality_check_of_a_table_other_jobs_read_is_blocking() -> None:
    repo = definitions.defs.get_repository_def()
    graph = repo.asset_graph
    blocking = {
        key.asset_key.to_user_string()
        for key in graph.asset_check_keys
        if key.name == "quality" and graph.get_check_spec(key).blocking
    }
    assert blocking == {"lake_payments"}


def _all_assets() -> list:
    jobs = list(load_jobs().jobs.values())
    upstream = lake_tables(jobs)
    parts = [build_job_assets(job, upstream) for job in jobs]
    return [*(a for p in parts for a in p.assets), *(c for p in parts for c in p.checks)]


def _duplicate_a_row(table: Path) -> None:
    """A writer outside onceflow appends a copy of one row: the payments table now holds a
    duplicate key and more rows than its committed windows."""
    rows = DeltaTable(str(table)).to_pyarrow_table().slice(0, 1)
    write_deltalake(str(table), pa.Table.from_batches(rows.to_batches()), mode="append")


@pytest.mark.dagster
def test_a_failed_gating_check_keeps_daily_totals_from_materialising(
    resources: dict, pg_dsn: str, lake: Path, landing: Path
) -> None:
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=7)
    assets = _all_assets()
    sinks = [AssetKey(k) for k in TABLES if k != "pg_daily_totals"]
    with DagsterInstance.ephemeral() as instance:
        # The check passes: payments and daily_totals materialise in one run.
        first = materialize(
            assets,
            selection=AssetSelection.assets(*sinks, AssetKey("pg_daily_totals")),
            resources=resources,
            instance=instance,
        )
        assert first.success
        mats = {m.asset_key.to_user_string(): m for m in first.get_asset_materialization_events()}
        assert set(mats) == set(TABLES)
        for key, name in TABLES.items():
            metadata = mats[key].materialization.metadata
            assert metadata["dagster/table_name"].value == name, key
        gate = [e for e in first.get_asset_check_evaluations() if e.asset_check_key == GATE]
        assert [e.passed for e in gate] == [True]

        _duplicate_a_row(lake / "payments")
        second = materialize(
            assets,
            selection=AssetSelection.checks(GATE) | AssetSelection.assets("pg_daily_totals"),
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
        gate = [e for e in second.get_asset_check_evaluations() if e.asset_check_key == GATE]
        assert [(e.passed, e.blocking) for e in gate] == [(False, True)]
        assert not second.success
        assert second.asset_materializations_for_node("daily_totals_run") == []
        # daily_totals' step never started: Dagster held it back on the failed check.
        assert not [e for e in second.all_events if e.step_key == "daily_totals_run"]
        logs = [e.user_message for e in instance.all_logs(second.run_id)]
        held = "Dependencies for step daily_totals_run failed: ['payments_quality']"
        assert any(held in line for line in logs)
