"""The operators as Airflow runs them, against the real `onceflow` command: the command line
they build, a retryable exit (75) as a plain exception so the task's retries apply, any other
failure as AirflowFailException, the JSON result as the XCom."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from onceflow_airflow import command
from onceflow_airflow.operators import (
    OnceflowMaintainOperator,
    OnceflowReconcileOperator,
    OnceflowRecoverOperator,
    OnceflowRestateOperator,
    OnceflowRetryableError,
    OnceflowRunOperator,
    OnceflowValidateOperator,
)


def test_the_command_lines() -> None:
    run = OnceflowRunOperator(task_id="r", job="payments", request_id="manual__1")
    assert run.argv() == ["run", "payments", "--run-id", "manual__1", "--json"]
    restate = OnceflowRestateOperator(task_id="s", job="payments", windows="3-7", request_id="x")
    assert restate.argv() == ["restate", "payments", "--windows", "3-7", "--run-id", "x", "--json"]
    recover = OnceflowRecoverOperator(task_id="c", job="payments", request_id="y")
    assert recover.argv() == ["recover", "payments", "--run-id", "y", "--json"]
    # validate and reconcile name no request.
    assert OnceflowValidateOperator(task_id="v", job="payments").argv() == [
        "validate",
        "payments",
        "--json",
    ]
    assert OnceflowReconcileOperator(task_id="o", job="payments").argv()[-1] == "--json"
    # maintain names its fence after the request.
    assert OnceflowMaintainOperator(task_id="m", job="payments", request_id="z").argv() == [
        "maintain",
        "payments",
        "--run-id",
        "z",
        "--json",
    ]
    # Airflow's run id by default.
    assert OnceflowRunOperator(task_id="d", job="j").request_id == "{{ run_id }}"
    assert "env" in OnceflowRunOperator.template_fields


def test_an_unreachable_postgres_is_a_retry(onceflow_env: dict[str, str]) -> None:
    op = OnceflowRecoverOperator(
        task_id="recover",
        job="payments",
        request_id="rec-1",
        env={
            "ONCEFLOW_POSTGRES_DSN": "postgresql://u@127.0.0.1:1/x?connect_timeout=1",
            "ONCEFLOW_PG_RETRY_S": "1",
        },
    )
    with pytest.raises(OnceflowRetryableError, match="exited 75: could not connect") as info:
        op.execute({})
    # A plain AirflowException: the task's retries apply (AirflowFailException skips them).
    assert not isinstance(info.value, AirflowFailException)


def test_a_terminal_failure_is_final(onceflow_env: dict[str, str]) -> None:
    op = OnceflowValidateOperator(task_id="validate", job="no_such_job")
    with pytest.raises(AirflowFailException, match=r"exited 1: .*no_such_job"):
        op.execute({})


def test_a_missing_command_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(command.COMMAND_ENV, str(tmp_path / "bin" / "onceflow"))
    with pytest.raises(FileNotFoundError, match="make setup"):
        OnceflowValidateOperator(task_id="v", job="payments").execute({})


def test_the_provider_is_registered() -> None:
    (entry,) = [e for e in entry_points(group="apache_airflow_provider") if "onceflow" in e.value]
    info = entry.load()()
    assert info["package-name"] == "airflow-provider-onceflow"
    from airflow.providers_manager import ProvidersManager

    assert "airflow-provider-onceflow" in ProvidersManager().providers
