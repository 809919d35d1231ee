"""Replayable sources: the same offsets always give the same records in the same order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceflow.sources.base import ArrowParse, ChangedUnit, Observation, Source
from onceflow.sources.landing import LandingFiles, LandingSource

if TYPE_CHECKING:
    from onceflow.sources.csv import CsvSource
    from onceflow.sources.delta import DeltaTableSource
    from onceflow.sources.parquet import ParquetSource

_LAZY = {
    "CsvSource": "onceflow.sources.csv",
    "ParquetSource": "onceflow.sources.parquet",
    "DeltaTableSource": "onceflow.sources.delta",
}


def __getattr__(name: str) -> Any:
    # Each kind imports its own readers only when a job uses it.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'onceflow.sources' has no attribute {name!r}")


__all__ = [
    "ArrowParse",
    "ChangedUnit",
    "CsvSource",
    "DeltaTableSource",
    "LandingFiles",
    "LandingSource",
    "Observation",
    "ParquetSource",
    "Source",
]
