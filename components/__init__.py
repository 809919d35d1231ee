"""Dagster components of onceflow (`dg`): one `OnceflowJobComponent` per job, under `defs/`."""

from __future__ import annotations

from components.job import OnceflowJobComponent

__all__ = ["OnceflowJobComponent"]
