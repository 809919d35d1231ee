"""Replayable sources: the same offsets always give the same records in the same order."""

from __future__ import annotations

from onceflow.sources.landing import LandingSource

__all__ = ["LandingSource"]
