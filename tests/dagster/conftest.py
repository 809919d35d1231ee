"""Fixtures of the Dagster tests: the resources of a run, on the session's real servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DagsterInstance

from resources import OnceflowSettingsResource, PostgresResource, SparkResource


@pytest.fixture()
def disk_instance(tmp_path: Path):
    """An instance on disk, as `dagster dev` has it: SQLite storage with its event log sharded
    by run, which also takes writes from a second thread while a run executes (an ephemeral
    instance's in-memory SQLite locks)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with DagsterInstance.local_temp(tempdir=str(home)) as inst:
        yield inst


@pytest.fixture()
def resources(spark, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path) -> dict:
    """Spark (the session's), a fresh PostgreSQL database and the test's folders."""
    return {
        "spark": SparkResource(),
        "postgres": PostgresResource(dsn=pg_dsn),
        "onceflow": OnceflowSettingsResource(
            home=str(tmp_path / "home"), lake=str(lake), landing=str(landing)
        ),
    }
