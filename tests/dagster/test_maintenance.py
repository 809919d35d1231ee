"""The maintenance job and schedule of a job with Delta sinks: built per job, run by Dagster
with the metadata on each sink asset (real Delta table, real PostgreSQL; no Spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import DagsterInstance, DefaultScheduleStatus

from assets.factory import build_job_assets
from assets.maintenance import build_maintenance
from onceflow.ledger import Ledger
from onceflow.registry import get_job
from onceflow.settings import Settings
from resources import OnceflowSettingsResource, PostgresResource
from tests.core.test_maintain import UP, _commit_window, _short_retention


def test_every_job_gets_a_daily_maintenance_schedule() -> None:
    payments = build_job_assets(get_job("payments"))
    assert "payments_maintenance_job" in [j.name for j in payments.jobs]
    (schedule,) = [s for s in payments.schedules if s.name == "payments_maintenance_schedule"]
    assert schedule.default_status == DefaultScheduleStatus.RUNNING
    assert schedule.cron_schedule == "30 3 * * *"
    # daily_totals writes PostgreSQL only: its ledger detail is what it maintains.
    totals = build_job_assets(get_job("daily_totals"))
    assert [s.name for s in totals.schedules if "maintenance" in s.name] == [
        "daily_totals_maintenance_schedule"
    ]


def test_the_maintenance_job_reports_on_each_sink_asset(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    home = tmp_path / "home"
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    for i in range(3):
        _commit_window(settings, pg_dsn, i)
    _short_retention(lake / "up")
    job, _ = build_maintenance(UP)
    resources = {
        "postgres": PostgresResource(dsn=pg_dsn),
        "onceflow": OnceflowSettingsResource(home=str(home), lake=str(lake), landing=str(landing)),
    }
    with DagsterInstance.ephemeral() as instance:
        result = job.execute_in_process(instance=instance, resources=resources)
    assert result.success
    (observed,) = [
        e.event_specific_data.asset_observation
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert observed.asset_key.to_user_string() == "maint_up_events"
    metadata = {k: v.value for k, v in observed.metadata.items()}
    assert metadata["files_before"] == 3 and metadata["files_compacted"] == 3
    assert metadata["files_after"] == 1 and metadata["files_vacuumed"] == 3
    assert metadata["bytes_after"] < metadata["bytes_before"]
    assert metadata["version_checkpointed"] >= 0
    assert metadata["vacuum_held_back_by"] == "nothing"


def test_the_maintenance_job_folds_the_ledger_past_the_days_it_is_told_to_keep(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """Run config `keep_detail_days: 0`: every window's plan folded, reported on the op's
    output; the default (30 days) keeps them."""
    home = tmp_path / "home"
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    for i in range(3):
        _commit_window(settings, pg_dsn, i)
    job, _ = build_maintenance(UP)
    resources = {
        "postgres": PostgresResource(dsn=pg_dsn),
        "onceflow": OnceflowSettingsResource(home=str(home), lake=str(lake), landing=str(landing)),
    }

    def output_metadata(run_config: dict[str, Any]) -> dict[str, Any]:
        with DagsterInstance.ephemeral() as instance:
            result = job.execute_in_process(
                instance=instance, resources=resources, run_config=run_config
            )
        assert result.success
        (output,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
        return {
            k: v.value
            for k, v in output.event_specific_data.metadata.items()  # type: ignore[union-attr]
        }

    kept = output_metadata({})
    assert kept["window_plans_folded"] == 0 and kept["ledger_detail_through_window"] == 0
    op = f"{UP.name}_maintain"
    folded = output_metadata({"ops": {op: {"config": {"keep_detail_days": 0}}}})
    assert folded["window_plans_folded"] == 3 and folded["ledger_detail_through_window"] == 3
    windows = Ledger(pg_dsn, UP.name).windows()
    assert [w.window_id for w in windows] == [1, 2, 3]
    assert all(w.offsets and w.completed for w in windows)  # read back from the folded row
