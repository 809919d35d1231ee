"""`OnceflowJobComponent`: one onceflow job's Dagster definitions from a `defs.yaml`.

    type: components.OnceflowJobComponent
    attributes:
      job: payments                 # a configured job's name, or `package.module:NAME`
      reconcile_cron: "0 * * * *"   # when the reconcile schedule runs recovery

The definitions are the factory's (`assets.build_job_assets`), the same as `definitions.py`
builds for the job; the resources come from `components/defs/resources.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg
from pydantic import Field

from assets import build_job_assets
from assets.factory import lake_tables
from onceflow import ConfigurationError, Job, load_jobs
from sensors.schedules import RECONCILE_CRON

# The variable `load_jobs` reads its import paths from.
JOBS_ENV = "ONCEFLOW_JOBS"


def resolve_job(ref: str) -> Job:
    """The job `ref` names: a configured job's name (`[tool.onceflow] jobs`, `ONCEFLOW_JOBS`,
    else the reference jobs), or an import path `package.module:NAME` of a user's Job (a
    module path alone when it defines one job).

    Raises:
        ConfigurationError: No such job, or the path names several.
    """
    if ":" not in ref and "." not in ref:
        return load_jobs().get(ref)
    found = load_jobs(env={JOBS_ENV: ref})
    if len(found.jobs) != 1:
        raise ConfigurationError(
            f"{ref} defines {len(found.jobs)} jobs ({', '.join(found.names)}); name one as "
            f"{ref.partition(':')[0]}:NAME in the component's `job`."
        )
    return next(iter(found.jobs.values()))


class OnceflowJobComponent(dg.Component, dg.Model, dg.Resolvable):
    """An onceflow job in Dagster: its source, sink assets (one engine run commits them all),
    recovery asset, quality and freshness checks, run/recovery/follow jobs, the new-data,
    failure and quality sensors, and the reconcile schedule."""

    job: str = Field(
        description=(
            "The job: a configured job's name (e.g. `payments`), or the import path of a "
            "user's Job (`package.module:NAME`)."
        )
    )
    reconcile_cron: str = Field(
        default=RECONCILE_CRON,
        description="Cron of the reconcile schedule (recovery and an incremental reconcile).",
    )
    upstream_jobs: Sequence[str] | None = Field(
        default=None,
        description=(
            "Jobs (names or import paths) whose Delta tables this job may read, for lineage: "
            "their sink asset becomes this job's upstream. Default: the configured jobs."
        ),
    )

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        job = resolve_job(self.job)
        writers = (
            [resolve_job(ref) for ref in self.upstream_jobs]
            if self.upstream_jobs is not None
            else list(load_jobs().jobs.values())
        )
        # The job's own tables are left out: a job never reads what it writes.
        upstream = lake_tables([w for w in writers if w.name != job.name])
        built = build_job_assets(job, upstream, reconcile_cron=self.reconcile_cron)
        return dg.Definitions(
            assets=built.assets,
            asset_checks=built.checks,
            jobs=built.jobs,
            sensors=built.sensors,
            schedules=built.schedules,
        )
