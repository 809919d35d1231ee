"""A deferrable sensor waiting for a job's new input (see `OnceflowPendingWorkTrigger`): it
holds no worker slot while it waits."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseSensorOperator

from onceflow_airflow.command import catalog
from onceflow_airflow.triggers import OnceflowPendingWorkTrigger


class OnceflowNewInputSensor(BaseSensorOperator):
    """Succeeds when `job` has unplanned input or pending windows; its XCom is that work."""

    template_fields = ("job",)

    def __init__(self, *, job: str, poll_interval: float = 30.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.poll_interval = poll_interval

    def poke(self, context: Any) -> bool | Any:
        work = catalog([self.job], pending=True)[self.job]["pending"]
        return work["any"]

    def execute(self, context: Any) -> Any:
        # Checked once here, so input already waiting starts the run without a deferral.
        work = catalog([self.job], pending=True)[self.job]["pending"]
        if work["any"]:
            return work
        self.defer(
            trigger=OnceflowPendingWorkTrigger(self.job, self.poll_interval),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        return event
