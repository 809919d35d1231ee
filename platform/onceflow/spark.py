"""Builds the Spark session onceflow runs on: local by default, any master or Spark Connect URL."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Settings every onceflow session needs, whatever the cluster: timestamps kept in UTC and
# written as INT64 micros so Delta readers agree, and no _SUCCESS/.crc litter in table folders.
_REQUIRED_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "spark.hadoop.parquet.enable.summary-metadata": "false",
}

# Defaults sized for one small machine; a cluster's own settings override them.
_LOCAL_DEFAULTS: dict[str, str] = {
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "2g",
    "spark.python.worker.reuse": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.adaptive.enabled": "true",
}


def build_spark_session(
    master: str | None = None,
    remote: str | None = None,
    app_name: str = "onceflow",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """Return a Spark session configured for onceflow.

    Args:
        master: A `spark.master` URL; `local[2]` when neither this nor `remote` is given.
        remote: A Spark Connect URL (`sc://host:port`); takes precedence over `master`.
        app_name: The Spark application name.
        conf: Extra Spark settings, applied after the defaults.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    else:
        builder = builder.master(master or "local[2]")
        for key, value in _LOCAL_DEFAULTS.items():
            builder = builder.config(key, value)
    for key, value in {**_REQUIRED_CONF, **dict(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not remote:
        session.sparkContext.setLogLevel("ERROR")
    return session
