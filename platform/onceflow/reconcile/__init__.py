"""Reconciliation: pull every sink, compare it with the expected state, repair the difference."""

from __future__ import annotations

from onceflow.reconcile._report import ReconcileReport, SinkDiff, format_report
from onceflow.reconcile._run import reconcile

__all__ = ["ReconcileReport", "SinkDiff", "format_report", "reconcile"]
