"""Run configuration of a job's runs and recovery runs, as the launchpad shows it."""

from __future__ import annotations

from typing import Literal

from dagster import Config
from pydantic import Field


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
