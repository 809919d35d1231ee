"""Reconciliation: pull every sink, compare it with the expected state, repair the difference."""

from __future__ import annotations

from onceflow.reconcile._expected import expected_outputs
from onceflow.reconcile._report import ReconcileReport, SinkDiff, format_report
from onceflow.reconcile._run import check_replay_horizon, parse_interval, reconcile

__all__ = [
    "ReconcileReport",
    "SinkDiff",
    "check_replay_horizon",
    "expected_outputs",
    "format_report",
    "parse_interval",
    "reconcile",
]
