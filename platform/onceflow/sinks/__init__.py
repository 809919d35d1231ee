"""Sinks and their commit protocols: one package per kind of sink, one protocol in each."""

from __future__ import annotations

from collections.abc import Sequence

from onceflow.sinks.base import SinkContext, SinkGroup, SinkOutcome, SinkSpec, TableFacts


def open_groups(specs: Sequence[SinkSpec], ctx: SinkContext) -> list[SinkGroup]:
    """Open a job's sinks as the groups that commit together, in the order of their kinds'
    first appearance in the job."""
    kinds: list[type[SinkSpec]] = []
    for spec in specs:
        if type(spec) not in kinds:
            kinds.append(type(spec))
    return [group for kind in kinds for group in kind.open_groups(specs, ctx)]


__all__ = ["SinkContext", "SinkGroup", "SinkOutcome", "SinkSpec", "TableFacts", "open_groups"]
