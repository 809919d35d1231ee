"""Real materialisations of the payments assets on Spark, PostgreSQL and Delta, against the oracle."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance, RunConfig, build_sensor_context, materialize

import definitions
from assets import RecoveryConfig, WindowRunConfig, build_job_assets
from onceflow.generate import generate_payments
from onceflow.registry import get_job
from tests.support.oracle import expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.dagster

SINKS = ["lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine"]


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture()
def retrying():
    """An instance that retries failed runs, as `dagster.yaml` configures `make dev`'s."""
    with DagsterInstance.ephemeral(
        settings={"run_retries": {"enabled": True, "max_retries": 2}}
    ) as inst:
        yield inst


def _payments_assets() -> list:
    source, sinks, _recovery = build_job_assets(get_job("payments")).assets
    return [source, sinks]


def _materialisations(result, node: str = "payments_run") -> dict:
    return {m.asset_key.to_user_string(): m for m in result.asset_materializations_for_node(node)}


def _value(mat, key: str):
    return mat.metadata[key].value


def _logs(instance: DagsterInstance, run_id: str) -> str:
    return "\n".join(e.user_message for e in instance.all_logs(run_id))


def test_new_data_backfill_noop_and_restate(
    resources: dict, instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    generate_payments(landing, records=2000, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=1)
    files = visible_files(landing)
    result = materialize(
        _payments_assets(),
        resources=resources,
        instance=instance,
        run_config=RunConfig({"payments_run": WindowRunConfig(max_files_per_window=2)}),
    )
    assert result.success
    mats = _materialisations(result)
    assert set(mats) == set(SINKS)
    lake_mat = mats["lake_payments"]
    assert _value(lake_mat, "windows") == "1-3"
    assert _value(lake_mat, "windows_committed") == 3
    version = _value(lake_mat, "delta_version")
    assert lake_mat.tags["dagster/data_version"] == str(version)
    expected = expected_outputs(landing, windows=[files[0:2], files[2:4], files[4:6]])
    assert _value(mats["pg_payments"], "rows_written") == len(expected.payments)
    assert _value(mats["pg_quarantine"], "rows_written") == len(expected.quarantine)
    assert _value(lake_mat, "duplicates") == expected.duplicates
    assert _value(lake_mat, "quarantined") == len(expected.quarantine)
    assert _value(mats["pg_payments"], "transaction_id")
    actual = actual_outputs(pg_dsn, lake)
    assert_exact(expected, actual)
    assert len(actual.pg_payments) == len(expected.payments)
    _assert_catalog_metadata(mats, actual, pg_dsn, lake, windows=[3, 2, 1])
    # The source was observed by the run, before it read: its data version is the landing's.
    (seen,) = result.asset_observations_for_node("payments_run")
    assert seen.asset_key.to_user_string() == "payments_landing"
    assert seen.tags["dagster/data_version"].startswith(f"6:{files[-1]}:")

    # The same backfill twice: nothing changes, and both runs say so.
    for _ in range(2):
        again = materialize(
            _payments_assets(),
            resources=resources,
            instance=instance,
            run_config=RunConfig({"payments_run": WindowRunConfig(windows="1-2")}),
        )
        assert again.success
        for sink, mat in _materialisations(again).items():
            assert _value(mat, "noop") is True, sink
            assert _value(mat, "windows") == "1-2"
            assert _value(mat, "windows_already_committed") == 2
            assert _value(mat, "rows_written") == 0
        lake_again = _materialisations(again)["lake_payments"]
        assert lake_again.tags["dagster/data_version"] == str(version)
        logs = _logs(instance, again.run_id)
        assert "window 1 already committed in every sink; nothing changed" in logs
        assert "window 2 already committed in every sink; nothing changed" in logs
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    never = materialize(
        _payments_assets(),
        resources=resources,
        instance=instance,
        run_config=RunConfig({"payments_run": WindowRunConfig(windows="9")}),
        raise_on_error=False,
    )
    assert not never.success
    assert "never planned" in _logs(instance, never.run_id) + str(
        never.failure_data_for_node("payments_run")
    )

    restate = materialize(
        _payments_assets(),
        resources=resources,
        instance=instance,
        run_config=RunConfig({"payments_run": WindowRunConfig(windows="2", restate=True)}),
        raise_on_error=False,
    )
    assert restate.success
    restated = _materialisations(restate)
    assert _value(restated["pg_merchant_balances"], "mode") == "restate"
    assert _value(restated["lake_payments"], "windows") == "2"
    # The lineage follows the restatement: window 2 is now held by the restating commit.
    lineage = {
        r.data["window"]: r.data for r in _value(restated["lake_payments"], "lineage").records
    }
    assert _version(lineage[2]) > version > _version(lineage[1])
    # Same transform: the restated window's effect is replaced by an identical one.
    assert_exact(expected, actual_outputs(pg_dsn, lake))


def test_terminal_failures_are_neither_retried_nor_recovered(
    resources: dict, retrying: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    """A typo in a backfill's windows, and a window PostgreSQL refuses: one failed run each,
    on an instance that retries runs (as `dagster.yaml` does), and no recovery requested. Once
    the table is fixed, the recovery job (the hourly schedule's, or launched by hand) replays
    the refused window."""
    instance = retrying
    defs = definitions.build_defs(resources)
    run_job = defs.resolve_job_def("payments_job")
    recovery_job = defs.resolve_job_def("payments_recovery_job")
    sensor = defs.resolve_sensor_def("payments_failure_sensor")

    generate_payments(landing, records=1000, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=1)
    first = visible_files(landing)
    ok = run_job.execute_in_process(instance=instance)
    assert ok.success
    # The job runs the quality checks of every sink it commits.
    quality = {e.asset_key.to_user_string(): e.passed for e in ok.get_asset_check_evaluations()}
    assert quality == dict.fromkeys(SINKS, True)

    typo = run_job.execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config=RunConfig({"payments_run": WindowRunConfig(windows="99")}),
    )
    # A real sink refusal: PostgreSQL refuses every new balance row.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE merchant_balances ADD CONSTRAINT t_block CHECK (false) NOT VALID")
    generate_payments(landing, records=1000, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=2)
    refused = run_job.execute_in_process(instance=instance, raise_on_error=False)
    for failed in (typo, refused):
        assert not failed.success
        run = instance.get_run_by_id(failed.run_id)
        assert run.tags["onceflow/job"] == "payments"
        # Dagster's verdict, taken when the run failed: no retry.
        assert run.tags["dagster/will_retry"] == "false", run.tags
        assert run.tags["onceflow/terminal_failure"] == failed.run_id
    assert "99" in str(typo.failure_data_for_node("payments_run"))

    tick = sensor(build_sensor_context(instance=instance, cursor=None))
    assert not getattr(tick, "run_requests", None)

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE merchant_balances DROP CONSTRAINT t_block")
    recovered = recovery_job.execute_in_process(
        instance=instance,
        run_config=RunConfig({"payments_recovery": RecoveryConfig(reconcile="full")}),
    )
    assert recovered.success
    (mat,) = recovered.asset_materializations_for_node("payments_recovery")
    assert mat.metadata["windows_replayed"].value == 1
    assert mat.metadata["windows_incomplete"].value == 0
    assert mat.metadata["reconcile_clean"].value is True
    for sink in SINKS:
        assert mat.metadata[f"{sink}.missing"].value == 0
        assert mat.metadata[f"{sink}.extra"].value == 0
    checks = {
        (e.asset_key.to_user_string(), e.check_name): e.passed
        for e in recovered.get_asset_check_evaluations()
    }
    assert checks.pop(("payments_recovery", "all_windows_committed")) is True
    # The recovery job evaluates the freshness checks too: every input is planned now.
    assert checks == {(sink, "input_planned_in_time"): True for sink in SINKS}

    later = [f for f in visible_files(landing) if f not in first]
    assert_exact(expected_outputs(landing, windows=[first, later]), actual_outputs(pg_dsn, lake))


def _version(record: dict) -> int:
    """The Delta version in a lineage record's `commit` (`v<version>`)."""
    return int(record["commit"].removeprefix("v"))


def _assert_catalog_metadata(
    mats: dict, actual, pg_dsn: str, lake: Path, windows: list[int]
) -> None:
    """The catalog's standard keys hold the sinks' real state, and the lineage table the
    view's rows, with no credentials anywhere."""
    from dagster import TableSchema

    from onceflow.lineage import lineage

    counts = {
        "lake_payments": len(actual.delta_payments),
        "pg_payments": len(actual.pg_payments),
        "pg_merchant_balances": len(actual.balances),
        "pg_quarantine": len(actual.quarantine),
    }
    database = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    password = psycopg.conninfo.conninfo_to_dict(pg_dsn).get("password")
    rows = {r.window_id: r for r in lineage(pg_dsn, "payments")}
    for sink, mat in mats.items():
        assert _value(mat, "dagster/row_count") == counts[sink], sink
        schema = _value(mat, "dagster/column_schema")
        assert isinstance(schema, TableSchema) and schema.columns
        uri = _value(mat, "dagster/uri")
        assert "@" not in uri and (not password or password not in str(mat.metadata))
        table = _value(mat, "lineage")
        assert [r.data["window"] for r in table.records] == windows
        for record in table.records:
            row = rows[record.data["window"]]
            assert record.data["rows_in"] == row.rows_in
            version, ref = row.data_versions.get(sink), row.commit_refs.get(sink)
            assert record.data["commit"] == (
                f"v{version}" if version is not None else f"commit {ref}"
            )
            assert record.data["state"] == "completed"
        # Narrow enough for the asset page; the full view is named.
        assert len(table.schema.columns) <= 6
        assert all(len(r.data["input"]) <= 40 for r in table.records)
        assert "onceflow.lineage" in _value(mat, "lineage_view")
    assert _value(mats["lake_payments"], "dagster/uri") == (lake / "payments").resolve().as_uri()
    assert _value(mats["pg_payments"], "dagster/uri").endswith(f"/{database}/public.payments")
    assert _value(mats["pg_quarantine"], "dagster/uri").startswith("postgresql://")
    assert [c.name for c in _value(mats["pg_payments"], "dagster/column_schema").columns][:1] == [
        "payment_id"
    ]
    lake_versions = [_version(r.data) for r in _value(mats["lake_payments"], "lineage").records]
    assert all(isinstance(v, int) for v in lake_versions)
    assert lake_versions == sorted(lake_versions, reverse=True)
