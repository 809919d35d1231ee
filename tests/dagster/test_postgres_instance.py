"""Dagster on PostgreSQL instance storage, configured by the block `dagster.yaml` ships: a real
`dagster dev` loads the definitions, runs a launched job, a refused backfill fails once (neither
retried nor recovered: its error is terminal) and a recovery run commits what landed meanwhile;
every sink exact, and the runs and events are in PostgreSQL, not SQLite."""

from __future__ import annotations

import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from onceflow.generate import generate_payments
from tests.support.dagster_dev import ROOT, dagster_dev_env, running_dagster_dev, wait_for
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(1200)]

JOB = "payments"
BLOCK = re.compile(r"# --- postgres storage ---\n(.*?)# --- end postgres storage ---\n", re.S)
RUN_TIMEOUT_S = 420
# Longer than the failure sensor's interval (30 s) and several of the retry daemon's ticks.
FAILURE_SENSOR_TICKS_S = 45


def postgres_instance_yaml() -> str:
    """The shipped `dagster.yaml` with its PostgreSQL storage block uncommented."""
    shipped = (ROOT / "dagster.yaml").read_text()
    found = BLOCK.search(shipped)
    assert found, "dagster.yaml lost its postgres storage block"
    block = "".join(line[2:] + "\n" for line in found.group(1).splitlines())
    return shipped.replace(found.group(0), block)


@pytest.fixture()
def dagster_db(pg_server_dsn: str) -> Iterator[str]:
    """A fresh database for Dagster's storage, as a SQLAlchemy URL."""
    name = f"dagster_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    user = info.get("user", "postgres")
    host = info.get("host", "")
    url = (
        f"postgresql+psycopg2://{user}@/{name}?host={host}"
        if host.startswith("/")
        else (f"postgresql+psycopg2://{user}@{host}:{info.get('port', 5432)}/{name}")
    )
    yield url
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _finished(dev, run_id: str) -> dict | None:
    run = next((r for r in dev.runs() if r["runId"] == run_id), None)
    return run if run and run["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None


def _judged(dev, run_id: str) -> dict | None:
    """The run once it ended and, if it failed, once Dagster tagged its retry verdict (the tag
    comes a moment after the FAILURE status)."""
    run = _finished(dev, run_id)
    if run and run["status"] == "FAILURE" and "dagster/will_retry" not in run["tags"]:
        return None
    return run


def test_dagster_on_postgres_storage_launches_runs_and_leaves_terminal_failures_alone(
    pg_dsn: str, dagster_db: str, pg_server_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    home = tmp_path / "dagster_home"
    env = dagster_dev_env(
        home,
        pg_dsn=pg_dsn,
        lake=lake,
        landing=landing,
        onceflow_home=tmp_path / "onceflow",
        extra={"DAGSTER_PG_URL": dagster_db, "ONCEFLOW_SENSOR_INTERVAL_S": "5"},
    )
    (home / "dagster.yaml").write_text(postgres_instance_yaml())
    generate_payments(
        landing, records=2000, files=2, duplicate_rate=0.05, invalid_rate=0.02, seed=5
    )
    try:
        with running_dagster_dev(env, tmp_path / "dagster_dev.log") as dev:
            dev.start_sensor(f"{JOB}_failure_sensor")
            for name in (f"{JOB}_new_data_sensor", "daily_totals_new_data_sensor"):
                dev.stop_sensor(name)
            for name in (f"{JOB}_reconcile_schedule", "daily_totals_reconcile_schedule"):
                dev.stop_schedule(name)

            launched = dev.launch(f"{JOB}_job", {})
            run = wait_for("the launched run", lambda: _finished(dev, launched), RUN_TIMEOUT_S, 1)
            assert run["status"] == "SUCCESS", run
            assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

            # A run that fails: a backfill of a window never planned is refused.
            generate_payments(landing, records=500, files=1, seed=6)
            bad = dev.launch(f"{JOB}_job", {"ops": {f"{JOB}_run": {"config": {"windows": "99"}}}})
            failed = wait_for("the refused backfill", lambda: _judged(dev, bad), RUN_TIMEOUT_S, 1)
            assert failed["status"] == "FAILURE", failed

            # Terminal (a typo cannot pass on a retry): Dagster's verdict says no retry, and
            # no retry or recovery follows, through several of the sensor's and daemon's ticks.
            assert failed["tags"]["dagster/will_retry"] == "false", failed
            assert failed["tags"]["onceflow/terminal_failure"] == bad, failed
            time.sleep(FAILURE_SENSOR_TICKS_S)
            followers = [
                r
                for r in dev.runs()
                if r["rootRunId"] == bad or r["tags"].get("onceflow/failed_run_id") == bad
            ]
            assert followers == [], followers

            # The recovery job, launched as the hourly schedule does, commits the file that
            # landed meanwhile.
            rescue = dev.launch(f"{JOB}_recovery_job", {})
            recovered = wait_for(
                "the recovery run", lambda: _finished(dev, rescue), RUN_TIMEOUT_S, 1
            )
            assert recovered["status"] == "SUCCESS", recovered
            assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

        # Dagster kept its runs and events in PostgreSQL.
        with psycopg.connect(_libpq(dagster_db, pg_server_dsn)) as conn:
            runs = {r[0] for r in conn.execute("SELECT run_id FROM runs")}
            events = conn.execute(
                "SELECT count(*) FROM event_logs WHERE run_id = %s", (launched,)
            ).fetchone()
        assert {launched, bad, rescue} <= runs
        assert events and events[0] > 0
        assert not list(home.glob("**/*.db")), "Dagster wrote SQLite storage after all"
    except BaseException:
        artifacts = ROOT / "tests" / "artifacts" / "postgres_instance"
        artifacts.mkdir(parents=True, exist_ok=True)
        if (tmp_path / "dagster_dev.log").exists():
            shutil.copy(tmp_path / "dagster_dev.log", artifacts / "dagster_dev.log")
        raise


def _libpq(url: str, server_dsn: str) -> str:
    """The libpq DSN of the database named in `url`, on the server of `server_dsn`."""
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = urlsplit(url).path.lstrip("/")
    return psycopg.conninfo.make_conninfo(**info)
