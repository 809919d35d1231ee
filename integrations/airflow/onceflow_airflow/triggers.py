"""A trigger firing when a job has work: input no window has planned, or planned windows some
sink lacks. It asks `python -m onceflow.ops.catalog JOB --pending` (the ledger and the source's
listing; no Spark) every `poll_interval` seconds in the triggerer, not in a worker slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from onceflow_airflow.command import command_env, onceflow_command, parse_result, project_dir


class OnceflowPendingWorkTrigger(BaseTrigger):
    def __init__(self, job: str, poll_interval: float = 30.0) -> None:
        super().__init__()
        self.job = job
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "onceflow_airflow.triggers.OnceflowPendingWorkTrigger",
            {"job": self.job, "poll_interval": self.poll_interval},
        )

    async def pending(self) -> dict[str, Any]:
        """The job's pending work, or `{"error": message}` when the look-up failed."""
        python = onceflow_command().parent / "python"
        proc = await asyncio.create_subprocess_exec(
            str(python),
            "-m",
            "onceflow.ops.catalog",
            self.job,
            "--pending",
            cwd=project_dir(),
            env=command_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        result = parse_result(out.decode())
        if proc.returncode != 0 or result is None:
            message = (result or {}).get("message") or err.decode().strip()[-2000:]
            return {"error": message, "exit_code": proc.returncode}
        return result["jobs"][self.job]["pending"]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            work = await self.pending()
            if "error" in work:
                # A transient look-up failure (PostgreSQL restarting) is polled again; the
                # sensor's timeout bounds how long.
                self.log.warning("onceflow pending work of %s: %s", self.job, work["error"])
            elif work["any"]:
                yield TriggerEvent({"job": self.job, **work})
                return
            await asyncio.sleep(self.poll_interval)
