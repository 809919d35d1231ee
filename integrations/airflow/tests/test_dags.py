"""The DAGs `build_job_dags` makes, run with `dag.test()` on embedded defaults (SQLite
metadata, the project's embedded PostgreSQL and local lake), the sinks checked against the
oracle in the project's venv (tests/exact.py): nothing lost, nothing doubled."""

from __future__ import annotations

import json
import os
from pathlib import Path

from airflow.sdk import DAG
from conftest import REPO, airflow_cli, assert_exact, distance, generate
from onceflow_airflow.dags import build_job_dags, job_catalog

# Killed (SIGKILL, by the process itself) between window 2's Delta commit and PostgreSQL's.
KILL_IN_WINDOW_2 = "pg_commit_sent@2"
RUN = ["--max-files-per-window", "2"]


def cli_json(stdout: str) -> list[dict[str, str]]:
    """The JSON list `airflow ... --output json` prints after its log lines."""
    lines = stdout.strip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("["))
    return json.loads("\n".join(lines[start:]))


def states(dag_run: object) -> dict[str, tuple[str, int]]:
    return {
        ti.task_id: (str(ti.state), ti.try_number)
        for ti in dag_run.get_task_instances()  # type: ignore[attr-defined]
    }


def test_a_run_killed_mid_window_is_retried_with_its_run_id_and_ends_exact(
    onceflow_env: dict[str, str],
) -> None:
    """The first try of `run` is killed inside window 2; Airflow's retry (the same run id)
    ends exact; validate's Asset events carry the run's windows and schedule daily_totals,
    whose own DAG then ends exact too."""
    generate()
    fault = "{{ '" + KILL_IN_WINDOW_2 + "' if ti.try_number == 1 and ti.task_id == 'run' else '' }}"
    dags = build_job_dags(
        "payments",
        jobs=job_catalog(refresh=True),
        env={"ONCEFLOW_FAULT": fault},
        run_arguments=RUN,
        retries=1,
    )
    dag_run = dags["payments"].test()
    got = states(dag_run)
    assert got["run"] == ("success", 2), got  # killed once, retried once
    assert got["validate"][0] == "success" and got["recover"][0] == "skipped", got
    assert_exact("payments")

    run_result = dag_run.get_task_instance("run").xcom_pull(task_ids="run")
    assert run_result["run_id"] == dag_run.run_id
    windows = [w["window_id"] for w in run_result["windows"]]
    assert windows and windows[-1] == 3, run_result

    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        # Earlier tests of the session registered the same asset name at their own lake's URI.
        lakes = [a.id for a in session.query(AssetModel).filter_by(name="lake_payments")]
        events = session.query(AssetEvent).filter(AssetEvent.asset_id.in_(lakes)).all()
        assert len(events) == 1
        lake_id = events[0].asset_id
        extra = events[0].extra
        assert extra["passed"] is True and extra["run"]["run_id"] == dag_run.run_id
        queued = session.query(AssetDagRunQueue).filter_by(target_dag_id="daily_totals").all()
        assert [q.asset_id for q in queued] == [lake_id], "daily_totals not scheduled"

    totals = build_job_dags("daily_totals", jobs=job_catalog())["daily_totals"]
    assert totals.test() is not None
    assert_exact("daily_totals")


def test_the_recover_task_after_a_failed_run_ends_exact(onceflow_env: dict[str, str]) -> None:
    generate()
    fault = "{{ '" + KILL_IN_WINDOW_2 + "' if ti.task_id == 'run' else '' }}"
    dags = build_job_dags(
        "payments",
        jobs=job_catalog(refresh=True),
        env={"ONCEFLOW_FAULT": fault},
        run_arguments=RUN,
        retries=0,
    )
    dag_run = dags["payments"].test()
    got = states(dag_run)
    assert got["run"][0] == "failed" and got["recover"][0] == "success", got
    assert got["validate"][0] == "upstream_failed", got
    before = distance("payments")
    assert_exact("payments")
    result = dag_run.get_task_instance("recover").xcom_pull(task_ids="recover")
    assert result["ok"] is True and result["reconcile"]["clean"] is True, result
    print(f"before recover: {before}")

    # The daily maintenance DAG on the recovered job: its Delta sink maintained, still exact.
    maintained = dags["payments_maintain"].test()
    assert states(maintained)["maintain"][0] == "success", states(maintained)
    report = maintained.get_task_instance("maintain").xcom_pull(task_ids="maintain")
    assert [t["sink"] for t in report["tables"]] == ["lake_payments"], report
    assert report["ledger_detail"]["through"] == 0, report  # every window is recent
    assert_exact("payments")


def test_a_user_job_outside_the_package_gets_its_dags(
    onceflow_env: dict[str, str], monkeypatch: object
) -> None:
    project = REPO / "tests" / "support" / "user_project"
    monkeypatch.setenv("ONCEFLOW_PROJECT_DIR", str(project))  # type: ignore[attr-defined]
    (Path(onceflow_env["ONCEFLOW_LANDING"]) / "orders").mkdir()
    jobs = job_catalog(refresh=True)
    assert set(jobs) == {"orders"}
    dags = build_job_dags("orders", jobs=jobs)
    assert sorted(dags) == ["orders", "orders_maintain", "orders_reconcile", "orders_restate"]
    assert all(isinstance(d, DAG) for d in dags.values())
    assert [a.name for a in dags["orders"].get_task("validate").outlets] == [
        "pg_orders",
        "orders_quarantine",
    ]
    assert os.environ["ONCEFLOW_PROJECT_DIR"] == str(project)


# Last: the DAG files' assets registered here (at this test's lake's URI) would otherwise stay
# the active ones of their names for the tests after it, whose lakes are elsewhere, and Airflow
# records no events for an asset that is not active.
def test_the_dag_files_import_cleanly(onceflow_env: dict[str, str]) -> None:
    job_catalog(refresh=True)
    airflow_cli("dags", "reserialize")
    errors = airflow_cli("dags", "list-import-errors", "--output", "json")
    assert cli_json(errors.stdout) == [], errors.stdout
    listed = airflow_cli("dags", "list", "--output", "json")
    ids = {d["dag_id"] for d in cli_json(listed.stdout)}
    for job in ("payments", "daily_totals"):
        assert {job, f"{job}_reconcile", f"{job}_restate", f"{job}_maintain"} <= ids
