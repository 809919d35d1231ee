"""Airflow provider for onceflow: operators running the project's `onceflow` command across a
process boundary (its own virtualenv), a deferrable sensor on a job's unplanned input, and
`build_job_dags`, the counterpart of the Dagster factory.

Nothing here imports onceflow: Airflow lives in `.venv-airflow`, onceflow in `.venv`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def get_provider_info() -> dict[str, Any]:
    """The provider's description, read by Airflow through the `apache_airflow_provider`
    entry point."""
    return {
        "package-name": "airflow-provider-onceflow",
        "name": "onceflow",
        "description": "Exactly-once Spark jobs into Delta and PostgreSQL, driven from Airflow.",
        "versions": [__version__],
        "operators": [
            {"integration-name": "onceflow", "python-modules": ["onceflow_airflow.operators"]}
        ],
        "sensors": [
            {"integration-name": "onceflow", "python-modules": ["onceflow_airflow.sensors"]}
        ],
        "triggers": [
            {"integration-name": "onceflow", "python-modules": ["onceflow_airflow.triggers"]}
        ],
        "config": {
            "onceflow": {
                "description": "Where the project's `onceflow` command is.",
                "options": {
                    "command": {
                        "description": "Path of the `onceflow` command (env ONCEFLOW_COMMAND "
                        "wins); default the project's .venv/bin/onceflow.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "/srv/onceflow/.venv/bin/onceflow",
                        "default": None,
                    },
                    "project_dir": {
                        "description": "Folder the commands run in (where a user's "
                        "pyproject.toml names its jobs); env ONCEFLOW_PROJECT_DIR wins.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "/srv/my_jobs",
                        "default": None,
                    },
                },
            }
        },
    }
