"""The freshness check fails while input older than the job's bound waits unplanned, and passes
once a run has taken it; the recovery job (and so the hourly reconcile) evaluates it too."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from dagster import AssetSelection, DagsterInstance, RunConfig, materialize

from assets import WindowRunConfig, build_job_assets
from assets.checks import FRESHNESS_CHECK
from onceflow.generate import generate_payments
from onceflow.registry import get_job
from tests.support.oracle import expected_outputs
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
