"""Dagster resources: Spark, PostgreSQL and onceflow's folders."""

from __future__ import annotations

from resources.defaults import default_resources
from resources.postgres import PostgresResource
from resources.settings import OnceflowSettingsResource
from resources.spark import SparkResource

__all__ = ["OnceflowSettingsResource", "PostgresResource", "SparkResource", "default_resources"]
