"""`build_job_dags(job)`: a job's four DAGs from one line in a DAG file, the counterpart of
the Dagster factory (assets/factory.py).

- `<job>`: new input (a deferrable sensor; for a job reading another job's Delta table, that
  table's Asset event schedules it) → `run` → `validate`, whose outlets are the job's sink
  Assets, so downstream DAGs start only on checked data; `recover` runs when `run` failed.
- `<job>_reconcile`: every sink diffed and repaired, on a schedule.
- `<job>_restate`: manual, a window range as a param; the request is the DAG run's id, so
  clearing and running the task again restates each window once.
- `<job>_maintain`: `onceflow maintain`, daily (the Dagster maintenance schedule's cadence).

Asset names are the sinks' names and their URIs the Dagster assets' `dagster/uri`, both from
`python -m onceflow.ops.catalog` (no Spark), cached for `CATALOG_TTL_S` so the DAG processor's
parses do not each start the project's Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, Param
from airflow.sdk.definitions.asset import AssetAll

from onceflow_airflow.command import catalog, onceflow_command, project_dir
from onceflow_airflow.operators import (
    OnceflowMaintainOperator,
    OnceflowReconcileOperator,
    OnceflowRecoverOperator,
    OnceflowRestateOperator,
    OnceflowRunOperator,
    OnceflowValidateOperator,
)
from onceflow_airflow.sensors import OnceflowNewInputSensor

CATALOG_TTL_S = 300.0
# Settings that change the tables' addresses or the jobs found.
_CATALOG_ENV = (
    "ONCEFLOW_HOME",
    "ONCEFLOW_LAKE",
    "ONCEFLOW_LANDING",
    "ONCEFLOW_POSTGRES_DSN",
    "ONCEFLOW_JOBS",
)
START = datetime(2026, 1, 1)


def _cache_file() -> Path:
    key = json.dumps(
        [str(onceflow_command()), str(project_dir()), *(os.environ.get(k) for k in _CATALOG_ENV)]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    home = os.environ.get("AIRFLOW_HOME") or tempfile.gettempdir()
    return Path(home) / f"onceflow-catalog-{digest}.json"


def job_catalog(refresh: bool = False) -> dict[str, Any]:
    """Every job's sinks and inputs (`onceflow.ops.catalog`), cached for `CATALOG_TTL_S`."""
    path = _cache_file()
    if not refresh and path.exists() and time.time() - path.stat().st_mtime < CATALOG_TTL_S:
        return json.loads(path.read_text())
    jobs = catalog()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jobs))
    tmp.replace(path)
    return jobs


def sink_assets(info: Mapping[str, Any]) -> list[Asset]:
    """The Assets of a job's sinks: named as the sinks, at their tables' addresses."""
    return [
        Asset(name=name, uri=facts["uri"])
        for name, facts in info["sinks"].items()
        if facts["uri"] is not None
    ]


def build_job_dags(
    job: str,
    *,
    jobs: Mapping[str, Any] | None = None,
    reconcile_schedule: str | None = "@daily",
    maintain_schedule: str | None = "30 3 * * *",
    retries: int = 2,
    retry_delay: timedelta = timedelta(seconds=5),
    poll_interval: float = 30.0,
    env: Mapping[str, str] | None = None,
    run_arguments: Sequence[str] = (),
) -> dict[str, DAG]:
    """The DAGs `<job>`, `<job>_reconcile`, `<job>_restate` and `<job>_maintain`, by DAG id; put
    them in a DAG file's globals: `globals().update(build_job_dags("orders"))`.

    Args:
        job: The onceflow job's name (as `onceflow jobs` lists it).
        jobs: The catalog (`job_catalog()`, the default).
        reconcile_schedule: When `<job>_reconcile` runs (None: manual).
        maintain_schedule: When `<job>_maintain` runs (daily at 03:30 by default; None: manual).
        retries: Retries of a retryable failure (exit 75) of run, recover and restate.
        poll_interval: Seconds between the new-input sensor's looks.
        env: Extra environment for the commands (templated).
        run_arguments: Extra arguments of `onceflow run` (`--max-files-per-window N`).
    """
    jobs = job_catalog() if jobs is None else jobs
    if job not in jobs:
        raise ValueError(
            f"onceflow knows no job {job!r} (it knows {sorted(jobs)}); name its module in "
            "ONCEFLOW_JOBS or the [tool.onceflow] table of the pyproject.toml in "
            "ONCEFLOW_PROJECT_DIR, then run `onceflow jobs` there"
        )
    info = jobs[job]
    common: dict[str, Any] = {"job": job, "env": dict(env or {})}
    retry = {"retries": retries, "retry_delay": retry_delay}
    inputs = [Asset(name=i["sink"], uri=i["uri"]) for i in info.get("inputs", [])]
    schedule: Any = AssetAll(*inputs) if len(inputs) > 1 else (inputs[0] if inputs else None)
    tags = ["onceflow", f"job:{job}"]

    with DAG(
        dag_id=job,
        schedule=schedule if inputs else "@continuous",
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=tags,
        doc_md=f"onceflow job `{job}`: new input → run → validate (recover if run failed).",
    ) as main:
        run = OnceflowRunOperator(task_id="run", arguments=list(run_arguments), **common, **retry)
        validate = OnceflowValidateOperator(
            task_id="validate", outlets=sink_assets(info), extra_from="run", **common
        )
        recover = OnceflowRecoverOperator(
            task_id="recover", trigger_rule="one_failed", **common, **retry
        )
        if not inputs:
            sensor = OnceflowNewInputSensor(
                task_id="new_input",
                job=job,
                poll_interval=poll_interval,
                timeout=timedelta(days=1),
            )
            sensor >> run
        run >> [validate, recover]

    with DAG(
        dag_id=f"{job}_reconcile",
        schedule=reconcile_schedule,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=tags,
        doc_md=f"Diffs every sink of `{job}` with what it should hold and repairs it.",
    ) as reconcile_dag:
        OnceflowReconcileOperator(task_id="reconcile", **common, **retry)

    with DAG(
        dag_id=f"{job}_restate",
        schedule=None,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=tags,
        params={
            "windows": Param("1", type="string", description="window ids, e.g. 3-7 or 3,5,9-10")
        },
        doc_md=f"Restates windows of `{job}`; a retry of the same DAG run restates each once.",
    ) as restate_dag:
        OnceflowRestateOperator(
            task_id="restate", windows="{{ params.windows }}", **common, **retry
        )

    with DAG(
        dag_id=f"{job}_maintain",
        schedule=maintain_schedule,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=tags,
        doc_md=f"Maintenance of `{job}`: its Delta sinks compacted, checkpointed and vacuumed "
        "past what readers still need; the ledger's old per-window detail dropped.",
    ) as maintain_dag:
        OnceflowMaintainOperator(task_id="maintain", **common, **retry)

    return {
        job: main,
        f"{job}_reconcile": reconcile_dag,
        f"{job}_restate": restate_dag,
        f"{job}_maintain": maintain_dag,
    }
