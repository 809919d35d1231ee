"""A job's maintenance in Dagster: an op job and its schedule (`onceflow maintain`).

Each run compacts, checkpoints, vacuums and cleans the log of the job's Delta sinks only past
the horizon onceflow computes, and reports on each sink asset (an observation: maintenance
changes no data) the files and bytes before and after, the versions checkpointed, the files
removed and which downstream job held files back; then drops the ledger's per-window detail
past the job's detail horizon (every job has some), reported on the op's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    MetadataValue,
    OpExecutionContext,
    Output,
    ScheduleDefinition,
    job,
    op,
)

from assets.config import MaintenanceConfig
from assets.runs import iter_at_boundary
from onceflow import Job, ops
from resources import OnceflowSettingsResource, PostgresResource
from resources._annotations import typed
from sensors.failure import KIND_TAG

# Daily, at a quiet hour: small files of a day's windows compacted, the log checkpointed.
MAINTENANCE_CRON = "30 3 * * *"


def table_metadata(table: Any) -> dict[str, Any]:
    """One sink's maintenance as asset metadata (ints, so the UI plots them)."""
    held = "; ".join(f"{h.job} {h.reason}" for h in table.binding) or "nothing"
    return {
        "files_before": MetadataValue.int(table.files_before),
        "files_after": MetadataValue.int(table.files_after),
        "bytes_before": MetadataValue.int(table.bytes_before),
        "bytes_after": MetadataValue.int(table.bytes_after),
        "live_files_after": MetadataValue.int(table.live_files_after),
        "files_compacted": MetadataValue.int(table.compacted_files),
        "version_checkpointed": MetadataValue.int(
            -1 if table.checkpoint_version is None else table.checkpoint_version
        ),
        "files_vacuumed": MetadataValue.int(table.files_vacuumed),
        "orphans_removed": MetadataValue.int(table.orphans_removed),
        "log_files_removed": MetadataValue.int(table.log_entries_removed),
        "log_records_kept_through": MetadataValue.int(table.log_records_through),
        "kept_from_version": MetadataValue.int(table.keep_version),
        "vacuum_held_back_by": MetadataValue.text(held),
    }


def build_maintenance(spec: Job, *, cron: str = MAINTENANCE_CRON) -> tuple[Any, ScheduleDefinition]:
    """The job's maintenance job and its schedule (daily by default, running)."""

    @op(
        name=f"{spec.name}_maintain",
        description=f"Compacts, checkpoints and vacuums {spec.name}'s Delta sinks past the "
        "horizon its downstream jobs, restatements and retention set, and drops the ledger's "
        "per-window detail past its detail horizon.",
    )
    @typed
    def _maintain(
        context: OpExecutionContext,
        config: MaintenanceConfig,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> Iterator[Any]:
        def events() -> Iterator[Any]:
            settings = onceflow.settings()
            result = ops.maintain(
                spec,
                settings,
                dsn=postgres.resolve(settings.home),
                run_id=context.run_id,
                keep_detail_days=config.keep_detail_days,
            )
            for line in result.lines():
                context.log.info(line)
            for table in result.tables:
                yield AssetObservation(
                    asset_key=AssetKey(table.sink), metadata=table_metadata(table)
                )
            detail = result.detail
            yield Output(
                len(result.tables),
                metadata={
                    "ledger_detail_through_window": MetadataValue.int(detail.through),
                    "lineage_rows_dropped": MetadataValue.int(detail.lineage_rows),
                    "contribution_rows_dropped": MetadataValue.int(detail.contribution_rows),
                    "commit_markers_folded": MetadataValue.int(detail.folded_records),
                    "window_plans_folded": MetadataValue.int(detail.folded_plans),
                },
            )

        yield from iter_at_boundary(events(), context)

    # Not tagged with the job's name: a failed maintenance needs no recovery of the job (it
    # changes no data), so the failure sensor leaves it alone.
    @job(
        name=f"{spec.name}_maintenance_job",
        tags={KIND_TAG: "maintenance", "onceflow/maintains": spec.name},
        description=f"Maintenance of {spec.name} (`onceflow maintain {spec.name}`).",
    )
    def _job() -> None:
        _maintain()

    schedule = ScheduleDefinition(
        name=f"{spec.name}_maintenance_schedule",
        job=_job,
        cron_schedule=cron,
        default_status=DefaultScheduleStatus.RUNNING,
        tags={"onceflow/trigger": "schedule"},
        description=f"Daily maintenance of {spec.name}.",
    )
    return _job, schedule
