#!/usr/bin/env bash
# `make airflow`: `airflow standalone` (SQLite metadata, LocalExecutor) with the project's DAGs
# (integrations/airflow/dags) on embedded defaults. The UI and API on AIRFLOW_PORT (8080); the
# admin's password is printed by Airflow and kept in $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
port=${AIRFLOW_PORT:-8080}
export AIRFLOW_HOME=${AIRFLOW_HOME:-$root/.airflow}
export AIRFLOW__CORE__DAGS_FOLDER=${AIRFLOW__CORE__DAGS_FOLDER:-$root/integrations/airflow/dags}
export AIRFLOW__CORE__LOAD_EXAMPLES=${AIRFLOW__CORE__LOAD_EXAMPLES:-False}
# Two cores: Spark jobs are heavy; two tasks at once.
export AIRFLOW__CORE__PARALLELISM=${AIRFLOW__CORE__PARALLELISM:-2}
export AIRFLOW__API__PORT=$port
# Where the UI's links and the workers' calls to the API point.
export AIRFLOW__API__BASE_URL=${AIRFLOW__API__BASE_URL:-http://localhost:$port}
export PYSPARK_PYTHON=${PYSPARK_PYTHON:-$root/.venv/bin/python}
export GX_ANALYTICS_ENABLED=false
# standalone starts its scheduler, API server and DAG processor as `airflow` commands.
export PATH="$root/.venv-airflow/bin:$PATH"
mkdir -p "$AIRFLOW_HOME"
cd "$root"
exec "$root/.venv-airflow/bin/airflow" standalone
