"""The reconcile schedule: a periodic recovery run, the safety net behind the failure sensor."""

from __future__ import annotations

from dagster import (
    DefaultScheduleStatus,
    ScheduleDefinition,
)

from onceflow import Job
from sensors._target import RunTarget

RECONCILE_CRON = "0 * * * *"


def build_reconcile_schedule(
    job: Job,
    recovery: RunTarget,
    *,
    cron: str = RECONCILE_CRON,
) -> ScheduleDefinition:
    """Runs `recovery` on `cron` (hourly by default): replay, verify, incremental reconcile."""
    return ScheduleDefinition(
        name=f"{job.name}_reconcile_schedule",
        job=recovery,
        cron_schedule=cron,
        default_status=DefaultScheduleStatus.RUNNING,
        tags={"onceflow/trigger": "schedule"},
        description=(
            f"Hourly recovery and reconciliation of {job.name}."
            if cron == RECONCILE_CRON
            else f"Recovery and reconciliation of {job.name} on `{cron}`."
        ),
    )
