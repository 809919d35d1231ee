"""Session fixtures: one real PostgreSQL server and one Spark session per test process."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-dsn",
        default=os.environ.get("ONCEFLOW_TEST_DSN"),
        help="PostgreSQL DSN to test against (default: an embedded pgserver started once)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` tests first: with the suite split by file over processes (`make test`), the
    long files start at once and the short ones fill in after, instead of one process running
    the last long files alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def pg_server_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """DSN of the session's PostgreSQL server (maintenance database)."""
    given = request.config.getoption("--test-dsn")
    if given:
        yield given
        return
    import pgserver

    # Not under pytest's private (0700) temp root: as root, pgserver runs PostgreSQL as its own
    # user, which must be able to reach the data folder.
    data = Path(tempfile.mkdtemp(prefix="onceflow-test-pg-"))
    data.chmod(0o755)
    server = pgserver.get_server(data, cleanup_mode="delete")
    yield server.get_uri()
    server.cleanup()


@pytest.fixture()
def pg_dsn(pg_server_dsn: str) -> Iterator[str]:
    """A fresh, empty database for one test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    info["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**info)
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


@pytest.fixture()
def lake(tmp_path: Path) -> Path:
    path = tmp_path / "lake"
    path.mkdir()
    return path


@pytest.fixture()
def landing(tmp_path: Path) -> Path:
    path = tmp_path / "landing"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def spark():
    """The test process's one Spark session."""
    from onceflow.spark import build_spark_session

    session = build_spark_session(app_name="onceflow-tests")
    yield session
    session.stop()
