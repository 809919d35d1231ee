"""Fixtures of the Dagster tests: the resources of a run, on the session's real servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from resources import OnceflowSettingsResource, PostgresResource, SparkResource


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
