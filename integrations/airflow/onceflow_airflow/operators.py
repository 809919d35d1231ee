"""Operators running `onceflow run|recover|restate|validate|reconcile|maintain JOB --json`.

The request's identity is Airflow's run id (`--run-id {{ run_id }}`), so a task's retry is the
same request and commits or restates nothing twice. Exit 75 (retryable), or a command killed
by a signal, raises a plain exception, so the task's `retries` apply; any other failure raises `AirflowFailException`
(no retry: running again fails the same way; `recover` repairs). The JSON result is the task's
XCom and the `extra` of the events of the task's outlet Assets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from onceflow_airflow.command import EXIT_RETRYABLE, Outcome, run_command

# The result's keys copied into an Asset event's `extra` (small: Airflow keeps it per event).
EXTRA_KEYS = (
    "operation",
    "job",
    "run_id",
    "ok",
    "epoch",
    "windows",
    "windows_committed",
    "rows_written",
    "restored",
    "windows_replayed",
    "incomplete",
    "checks",
    "passed",
)


class OnceflowRetryableError(AirflowException):
    """The command exited 75: transient; the task's retries run it again with the same id."""


class OnceflowOperator(BaseOperator):
    """Runs `onceflow COMMAND JOB [ARGS] [--run-id ID] --json` in the project's environment."""

    command: ClassVar[str] = ""
    # Commands taking `--run-id` (validate and reconcile name no request).
    takes_run_id: ClassVar[bool] = True
    template_fields: Sequence[str] = ("job", "request_id", "arguments", "env")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        job: str,
        request_id: str | None = "{{ run_id }}",
        arguments: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        extra_from: str | None = None,
        **kwargs: Any,
    ) -> None:
        """`extra_from`: a task whose result joins this one's in the Asset events' `extra`
        (the factory's validate task carries the run's windows, offsets and versions)."""
        super().__init__(**kwargs)
        self.extra_from = extra_from
        self.job = job
        self.request_id = request_id
        self.arguments = list(arguments)
        self.env = dict(env or {})

    def argv(self) -> list[str]:
        out = [self.command, self.job, *self.arguments]
        if self.takes_run_id and self.request_id:
            out += ["--run-id", self.request_id]
        return [*out, "--json"]

    def execute(self, context: Any) -> dict[str, Any] | None:
        outcome = run_command(self.argv(), env=self.env)
        self.log.info("%s exited %s", " ".join(outcome.argv), outcome.returncode)
        if outcome.stderr:
            self.log.info("stderr:\n%s", outcome.stderr[-20000:])
        if outcome.returncode != 0:
            raise self.failure(outcome)
        self.record_events(context, outcome.result or {})
        return outcome.result

    def failure(self, outcome: Outcome) -> Exception:
        """The exception for a failed command: retryable (75) or final."""
        what = f"onceflow {self.command} {self.job} exited {outcome.returncode}: {outcome.message}"
        # Killed by a signal (a lost worker, the OOM killer): the outcome is unknown, and the
        # same run id makes running it again safe.
        if outcome.returncode == EXIT_RETRYABLE or outcome.returncode < 0:
            return OnceflowRetryableError(what)
        return AirflowFailException(what)

    def record_events(self, context: Any, result: Mapping[str, Any]) -> None:
        """The result as the `extra` of each outlet Asset's event."""
        if not self.outlets:
            return
        extra: dict[str, Any] = {k: result[k] for k in EXTRA_KEYS if k in result}
        if self.extra_from:
            earlier = context["ti"].xcom_pull(task_ids=self.extra_from)
            if isinstance(earlier, Mapping):
                extra[self.extra_from] = {k: earlier[k] for k in EXTRA_KEYS if k in earlier}
        events = context["outlet_events"]
        for outlet in self.outlets:
            events[outlet].extra.update(extra)


class OnceflowRunOperator(OnceflowOperator):
    """`onceflow run JOB`: new input into every sink, each window once."""

    command = "run"


class OnceflowRecoverOperator(OnceflowOperator):
    """`onceflow recover JOB`: lost windows put back, pending ones replayed, sinks verified."""

    command = "recover"


class OnceflowRestateOperator(OnceflowOperator):
    """`onceflow restate JOB --windows RANGE`: the windows computed again, each once per run id."""

    command = "restate"
    template_fields: Sequence[str] = (*OnceflowOperator.template_fields, "windows")

    def __init__(self, *, windows: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.windows = windows

    def argv(self) -> list[str]:
        args = super().argv()
        return [*args[:2], "--windows", str(self.windows), *args[2:]]


class OnceflowValidateOperator(OnceflowOperator):
    """`onceflow validate JOB`: the sinks checked against the ledger (exit 4: checks failed)."""

    command = "validate"
    takes_run_id = False


class OnceflowReconcileOperator(OnceflowOperator):
    """`onceflow reconcile JOB`: every sink diffed with what it should hold, and repaired."""

    command = "reconcile"
    takes_run_id = False


class OnceflowMaintainOperator(OnceflowOperator):
    """`onceflow maintain JOB`: Delta sinks compacted, checkpointed and vacuumed past the horizon
    onceflow computes, the ledger's old per-window detail dropped (`--run-id` names the fence
    taken to remove orphan files)."""

    command = "maintain"
