"""Run configuration of a job's runs and recovery runs, as the launchpad shows it."""

from __future__ import annotations

import os
from typing import Literal

from dagster import Config
from pydantic import Field

from onceflow import ConfigurationError

DELIVERY_ENV = "ONCEFLOW_DELIVERY"
DELIVERIES = ("follow", "runs")


def delivery() -> Literal["follow", "runs"]:
    """How the new-data sensor brings new input to the sinks, from `ONCEFLOW_DELIVERY`:

    - `follow` (default): one follow run per job, started when input is waiting; it commits
      each new file within seconds and makes way for any other run of the job.
    - `runs`: one run of the job per batch of new input (a run's start, seconds, per batch).
    """
    value = os.environ.get(DELIVERY_ENV, "").strip().lower() or "follow"
    if value not in DELIVERIES:
        raise ConfigurationError(
            f"{DELIVERY_ENV}={value!r} is not a delivery: set it to one of "
            f"{', '.join(DELIVERIES)}, or leave it unset for follow."
        )
    return value  # type: ignore[return-value]


class WindowRunConfig(Config):
    """What a run of a job does. Empty: process new data.

    Attributes:
        max_files_per_window: Most units (files, or table versions for a Delta source) a new
            window takes (the engine's default when empty).
        windows: Past windows to backfill, e.g. `"3-7"` or `"3,5,9-10"`. A window every sink
            already holds is left alone and reported as a no-op.
        restate: With `windows`, replace exactly those windows' effect in every sink.
    """

    max_files_per_window: int | None = Field(default=None, ge=1)
    windows: str = ""
    restate: bool = False


class RecoveryConfig(Config):
    """What a recovery run does after replaying pending windows.

    Attributes:
        reconcile: `incremental` (windows since the last verified one), `full` (every window),
            or `off` (replay and verify commit markers only).
        dry_run: Report the differences reconcile finds without repairing them.
        verify_last: Check the commit state of the last this-many windows (0: every window).
    """

    reconcile: Literal["incremental", "full", "off"] = "incremental"
    dry_run: bool = False
    verify_last: int = Field(default=1000, ge=0)


class MaintenanceConfig(Config):
    """What a maintenance run keeps.

    Attributes:
        keep_detail_days: Windows planned within this many days keep their per-window detail
            (lineage rows, contributions, unfolded commit markers and plans); empty: 30.
    """

    keep_detail_days: float | None = Field(default=None, ge=0)
