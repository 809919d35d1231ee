"""Sinks and their commit protocols: one package per kind of sink, one protocol in each;
`onceflow.sinks.registry` opens a job's sinks as their groups."""

from __future__ import annotations

from onceflow.sinks.base import SinkContext, SinkGroup, SinkOutcome, SinkSpec, TableFacts

__all__ = ["SinkContext", "SinkGroup", "SinkOutcome", "SinkSpec", "TableFacts"]
