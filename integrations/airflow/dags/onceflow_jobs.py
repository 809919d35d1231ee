"""The project's jobs as Airflow DAGs: each job onceflow finds gets `<job>`, `<job>_reconcile`,
`<job>_restate` and `<job>_maintain` (onceflow_airflow.dags.build_job_dags)."""

from __future__ import annotations

from onceflow_airflow.dags import build_job_dags, job_catalog

for _job in job_catalog():
    globals().update(build_job_dags(_job))
