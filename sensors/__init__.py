"""Sensors and schedules: new data, failed runs, periodic reconciliation."""

from __future__ import annotations

from sensors.failure import build_failure_sensor
from sensors.new_data import build_new_data_sensor
from sensors.schedules import build_reconcile_schedule

__all__ = ["build_failure_sensor", "build_new_data_sensor", "build_reconcile_schedule"]
