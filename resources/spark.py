"""The Spark resource: onceflow's session on top of `dagster_pyspark.PySparkResource`."""

from __future__ import annotations

import os
from typing import Any

from dagster import InitResourceContext
from dagster_pyspark import PySparkResource
from pydantic import Field


class SparkResource(PySparkResource):
    """A Spark session configured for onceflow: local by default, any master or Spark Connect.

    An active session in the process (a test's, a notebook's) is reused rather than doubled,
    since one JVM per process is all Spark supports.

    Attributes:
        spark_config: Extra Spark settings, applied after onceflow's defaults.
        master: A `spark.master` URL; `local[2]` when empty and `remote` is empty.
        remote: A Spark Connect URL (`sc://host:15002`, see `onceflow spark-server`); takes
            precedence over `master`. Empty: `ONCEFLOW_SPARK_REMOTE`, then `ONCEFLOW_SPARK_MASTER`
            from the run's environment, so `make dev` attaches every run to its one server.
        app_name: The Spark application name.
        reuse_active: Use the process's active session when there is one.
    """

    spark_config: dict[str, Any] = Field(default_factory=dict)
    master: str = ""
    remote: str = ""
    app_name: str = "onceflow"
    reuse_active: bool = True

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    def setup_for_execution(self, context: InitResourceContext) -> None:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession() if self.reuse_active else None
        if active is not None:
            self._spark_session = active
            return
        from onceflow import build_spark_session

        self._spark_session = build_spark_session(
            master=self.master or os.environ.get("ONCEFLOW_SPARK_MASTER") or None,
            remote=self.remote or os.environ.get("ONCEFLOW_SPARK_REMOTE") or None,
            app_name=self.app_name,
            conf={key: str(value) for key, value in self.spark_config.items()},
        )
