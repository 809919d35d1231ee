"""What a run, a recovery or a backfill did, window by window."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onceflow.sinks.contract import SinkOutcome


@dataclass
class WindowResult:
    """What a run did with one window."""

    window_id: int
    offsets: dict[str, Any]
    stats: dict[str, Any]
    sinks: dict[str, SinkOutcome] = field(default_factory=dict)
    latency_s: float = 0.0  # planned → completed (every sink committed, ledger marked)
    compute_s: float = 0.0  # reading, parsing, deduplicating and staging the window
    # Planned → committed in every sink: its rows visible everywhere (before it is marked
    # completed and its keys indexed).
    visible_s: float = 0.0

    @property
    def noop(self) -> bool:
        return all(s.already_committed for s in self.sinks.values())


@dataclass
class RunResult:
    """What one run of a job did."""

    job: str
    run_id: str
    epoch: int
    windows: list[WindowResult] = field(default_factory=list)


@dataclass
class Replayed:
    """Per sink, the completed windows it lacked that were committed to it again (`restored`),
    and those that were not (`left`): their input is gone (`gone`, window ids), or an earlier
    window the sink lacks is."""

    restored: dict[str, list[int]] = field(default_factory=dict)
    left: dict[str, list[int]] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)


@dataclass
class RecoveryResult:
    """What a recovery did: completed windows put back into sinks that lost them, then a run."""

    run: RunResult
    restored: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class BackfillResult:
    """What a backfill of chosen windows did."""

    windows: list[WindowResult] = field(default_factory=list)
    noop_windows: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def commits(outcomes: Mapping[str, SinkOutcome]) -> list[SinkOutcome]:
    """The sink commits that wrote the window, for the ledger's record of each (which lineage
    reads): those this run made, and those an earlier run made whose record the sink gave
    (`window.complete.add_records`)."""
    return [
        o
        for o in outcomes.values()
        if o.committed or o.data_version is not None or o.commit_ref is not None
    ]
