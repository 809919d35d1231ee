"""The resources of a deployment on the defaults: everything from the environment."""

from __future__ import annotations

from typing import Any

from resources.postgres import PostgresResource
from resources.settings import OnceflowSettingsResource
from resources.spark import SparkResource


def default_resources() -> dict[str, Any]:
    """Local Spark, PostgreSQL from `ONCEFLOW_POSTGRES_DSN` (else embedded), folders from env."""
    return {
        "spark": SparkResource(),
        "postgres": PostgresResource.from_env(),
        "onceflow": OnceflowSettingsResource(),
    }
