"""Observations of a job's source asset: its data version is the source's own (the newest
landing file, the source table's version), so staleness and lag in the UI are real."""

from __future__ import annotations

from dagster import AssetKey, AssetObservation, MetadataValue

from onceflow import Job, Settings

# The tag Dagster reads an observation's data version from (`DATA_VERSION_TAG`, not exported).
DATA_VERSION_TAG = "dagster/data_version"


def source_observation(job: Job, key: AssetKey, settings: Settings) -> AssetObservation:
    """An observation of the job's source now (cheap: a folder or Delta log listing)."""
    seen = job.source.observe(settings)
    return AssetObservation(
        asset_key=key,
        tags={DATA_VERSION_TAG: seen.version},
        metadata={"units": MetadataValue.int(seen.units), **dict(seen.metadata)},
    )


def observed_version(observation: AssetObservation) -> str:
    return str(observation.tags[DATA_VERSION_TAG])
