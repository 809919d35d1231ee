"""The Dagster definitions of onceflow: every configured job's assets, checks, jobs and sensors.

The same definitions, one component per job, load from `components/defs/` (`dg check defs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster import Definitions

from assets import build_job_assets
from assets.factory import lake_tables
from onceflow import load_jobs
from resources import default_resources


def build_defs(resources: Mapping[str, Any] | None = None) -> Definitions:
    """Assemble the definitions of every configured job (`onceflow.registry`) on `resources`
    (default: from the environment)."""
    jobs = list(load_jobs().jobs.values())
    upstream = lake_tables(jobs)
    parts = [build_job_assets(job, upstream) for job in jobs]
    return Definitions(
        assets=[a for p in parts for a in p.assets],
        asset_checks=[c for p in parts for c in p.checks],
        jobs=[j for p in parts for j in p.jobs],
        sensors=[s for p in parts for s in p.sensors],
        schedules=[s for p in parts for s in p.schedules],
        resources=dict(resources) if resources is not None else default_resources(),
    )


defs = build_defs()
