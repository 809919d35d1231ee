"""The new-data sensor: one run request per batch of landing files it has not seen."""

from __future__ import annotations

import os
from collections.abc import Mapping

from dagster import (
    DefaultSensorStatus,
    JobDefinition,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from onceflow.job import Job
from resources._annotations import typed
from resources.settings import OnceflowSettingsResource

INTERVAL_ENV = "ONCEFLOW_SENSOR_INTERVAL_S"
DEFAULT_INTERVAL_S = 30


def default_interval_s() -> int:
    """`ONCEFLOW_SENSOR_INTERVAL_S` when set (at least 1), else 30 seconds.

    Dagster's sensor daemon ticks at most every 5 seconds, whatever is set here.
    """
    value = os.environ.get(INTERVAL_ENV, "").strip()
    return max(1, int(value)) if value else DEFAULT_INTERVAL_S


def build_new_data_sensor(
    job: Job,
    target: JobDefinition | UnresolvedAssetJobDefinition,
    tags: Mapping[str, str],
    *,
    interval_s: int | None = None,
) -> SensorDefinition:
    """A sensor requesting a run of `target` whenever the job's source shows new input.

    The cursor is the source's observation token (`Source.observe`: the newest landing file,
    the table version); a different token means new input. The run key is that token, so new
    input is requested once, and the engine plans input by itself, so a run finding nothing
    new is harmless. The interval defaults to `default_interval_s()`.
    """

    @sensor(
        name=f"{job.name}_new_data_sensor",
        job=target,
        minimum_interval_seconds=interval_s if interval_s is not None else default_interval_s(),
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Requests a run of {job.name} when new input appears in its source.",
    )
    @typed
    def _new_data(
        context: SensorEvaluationContext, onceflow: OnceflowSettingsResource
    ) -> SensorResult | SkipReason:
        seen = job.source.observe(onceflow.settings())
        if seen.units == 0 or seen.version == (context.cursor or ""):
            return SkipReason(f"no new input in {job.source.describe()}")
        return SensorResult(
            run_requests=[
                RunRequest(
                    run_key=f"{job.name}:{seen.version}",
                    tags={**tags, "onceflow/source_version": seen.version[:200]},
                )
            ],
            cursor=seen.version,
        )

    return _new_data
