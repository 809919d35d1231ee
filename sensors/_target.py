"""The type of the jobs sensors and schedules request."""

from __future__ import annotations

from typing import Any, TypeAlias

# A `JobDefinition`, or what `define_asset_job` returns: an unresolved asset job, resolved
# against the Definitions. Dagster does not export that class (it lives in `dagster._core`,
# which this layer never imports), so the alias cannot name it; `sensor(job=…)` and
# `ScheduleDefinition(job=…)` check the value themselves.
RunTarget: TypeAlias = Any
