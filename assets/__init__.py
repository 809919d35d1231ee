"""Dagster assets and asset checks, built from onceflow jobs by a factory."""

from __future__ import annotations

from assets.config import RecoveryConfig, WindowRunConfig
from assets.factory import JobDefs, build_job_assets

__all__ = ["JobDefs", "RecoveryConfig", "WindowRunConfig", "build_job_assets"]
