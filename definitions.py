"""The Dagster definitions of onceflow: every shipped job's assets, checks, jobs and sensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster import Definitions

from assets import build_job_assets
from onceflow.jobs import JOB_NAMES, get_job
from resources import OnceflowSettingsResource, PostgresResource, SparkResource


def default_resources() -> dict[str, Any]:
    """Local Spark, PostgreSQL from `ONCEFLOW_POSTGRES_DSN` (else embedded), folders from env."""
    return {
        "spark": SparkResource(),
        "postgres": PostgresResource.from_env(),
        "onceflow": OnceflowSettingsResource(),
    }


def build_defs(resources: Mapping[str, Any] | None = None) -> Definitions:
    """Assemble the definitions of every job in `JOB_NAMES` on `resources` (default: env)."""
    parts = [build_job_assets(get_job(name)) for name in JOB_NAMES]
    return Definitions(
        assets=[a for p in parts for a in p.assets],
        asset_checks=[c for p in parts for c in p.checks],
        jobs=[j for p in parts for j in p.jobs],
        sensors=[s for p in parts for s in p.sensors],
        schedules=[s for p in parts for s in p.schedules],
        resources=dict(resources) if resources is not None else default_resources(),
    )


defs = build_defs()
