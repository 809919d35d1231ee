"""A user's own job meets ordinary mistakes, through the real `onceflow` command: the README's
`orders` job (tests/support/user_project) named in ONCEFLOW_JOBS from the folder it lives in.

Input that never arrives is an error that names the folder; a committed file that changed is a
warning; a sink column changed by hand is named with the SQL that fixes it; a window id column
works after a `select`; Spark's logs stay off the terminal unless ONCEFLOW_DEBUG asks for them
(then the whole traceback); `status` into a closed pipe ends quietly and stops the embedded
server it started. Runs that only set up or close a scenario run in-process on the session's
Spark (no JVM start of their own).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from onceflow import ops
from onceflow.settings import Settings
from tests.support.cli import ONCEFLOW, RUN_TIMEOUT_S, CliRun, cli_env
from tests.support.orders_data import (
    JOB,
    USER_PROJECT,
    assert_orders_exact,
    one_file_per_window,
    user_project_on_path,
    write_orders,
)

MODULE = "orders_jobs"


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """The user's folder: their job module and nothing else (no pyproject.toml)."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(USER_PROJECT / f"{MODULE}.py", folder)
    return folder


def _env(home: Path, dsn: str, lake: Path, landing: Path, **extra: str) -> dict[str, str]:
    # PYTHONPATH stays as the test process has it (onceflow's code), never the project's.
    return cli_env(
        home=home, dsn=dsn, lake=lake, landing=landing, **{"ONCEFLOW_JOBS": MODULE, **extra}
    )


def onceflow(
    args: list[str], env: dict[str, str], cwd: Path, *, rc: int | None = 0
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [ONCEFLOW, *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if rc is not None:
        assert done.returncode == rc, (
            f"onceflow {' '.join(args)} exited {done.returncode}, not {rc}\n"
            f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
        )
    return done


def test_a_missing_source_folder_is_an_error_naming_it(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    env = _env(tmp_path / "home", pg_dsn, lake, landing)
    folder = landing / "orders"
    # ONCEFLOW_JOBS=orders_jobs from the module's folder, with no PYTHONPATH=. set.
    listed = onceflow(["jobs"], env, project)
    assert listed.stdout.splitlines()[0] == "jobs from ONCEFLOW_JOBS:"

    # A misspelled or missing folder: before, `0 window(s)` and exit 0.
    run = onceflow(["run", JOB], env, project, rc=1)
    assert f"the source folder {folder} does not exist" in run.stderr, run.stderr
    assert f"ONCEFLOW_LANDING={landing}" in run.stderr
    assert f"mkdir -p {folder}" in run.stderr
    assert "Traceback" not in run.stderr and "window(s)" not in run.stdout

    # ONCEFLOW_DEBUG=1: the same message, after the whole traceback down to where it was raised.
    debug = onceflow(["run", JOB], {**env, "ONCEFLOW_DEBUG": "1"}, project, rc=1)
    assert debug.stderr.startswith("Traceback (most recent call last):"), debug.stderr
    assert "in check_input" in debug.stderr
    assert debug.stderr.rstrip().endswith(run.stderr.strip().splitlines()[-1])

    status = onceflow(["status", JOB], env, project)
    assert f"at {folder}" in status.stdout
    assert "does not exist" in status.stdout
    as_json = json.loads(onceflow(["status", JOB, "--json"], env, project).stdout)
    assert as_json["source_location"] == str(folder)
    assert "does not exist" in as_json["source_problem"]

    # An empty folder is fine: nothing to do yet.
    folder.mkdir()
    empty = onceflow(["run", JOB], env, project)
    assert "0 window(s)" in empty.stdout
    assert (
        json.loads(onceflow(["status", JOB, "--json"], env, project).stdout)["source_problem"]
        is None
    )


def test_a_committed_file_that_changed_is_a_warning(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    env = _env(tmp_path / "home", pg_dsn, lake, landing)
    write_orders(landing)
    onceflow(["run", JOB, "--max-files-per-window", "1"], env, project)
    assert_orders_exact(pg_dsn, one_file_per_window())
    quiet = onceflow(["status", JOB], env, project)
    assert "WARNING" not in quiet.stdout

    # A row appended to a committed file (window 1), and a file touched (window 2).
    first, second = landing / "orders" / "orders-001.csv", landing / "orders" / "orders-002.csv"
    with first.open("a") as handle:
        handle.write("o10,Judy,500,2024-05-04T10:00:00Z\n")
    later = time.time() + 5
    os.utime(second, (later, later))

    run = onceflow(["run", JOB], env, project)
    assert "0 window(s)" in run.stdout
    assert "2 input file(s) changed after their window committed" in run.stderr, run.stderr
    assert "orders/orders-001.csv (window 1): now " in run.stderr
    assert "orders/orders-002.csv (window 2): same size, modified" in run.stderr
    assert "Land added records in a new file" in run.stderr
    assert "o10" not in run.stderr and "Judy" not in run.stderr  # never a row's values
    # Nothing was delivered again or lost: the sinks hold exactly the committed windows.
    assert_orders_exact(pg_dsn, one_file_per_window())

    status = onceflow(["status", JOB], env, project)
    assert "WARNING: job orders: 2 input file(s) changed" in status.stdout, status.stdout
    changed = json.loads(onceflow(["status", JOB, "--json"], env, project).stdout)["changed_input"]
    assert [(c["window_id"], c["unit"]) for c in changed] == [
        (1, "orders/orders-001.csv"),
        (2, "orders/orders-002.csv"),
    ]

    # A removed committed file is not a change (producers may clean up).
    first.unlink()
    second.unlink()
    assert "WARNING" not in onceflow(["status", JOB], env, project).stdout


def _stopped(pid: int, timeout: float = 240) -> None:
    """Wait until `pid` is stopped (SIGSTOP) by its fault point."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.2)
    raise AssertionError("the run never reached its fault point")


def test_a_renamed_sink_column_is_named_with_the_sql_that_fixes_it(
    spark, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    home = tmp_path / "home"
    env = _env(home, pg_dsn, lake, landing)
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    # The runs around the refusals are in-process on the session's Spark: the refusals'
    # messages are the command's, what the runs commit is not.
    write_orders(landing, ["orders-001.csv"])
    with user_project_on_path() as user:
        ops.run(user.ORDERS, settings, spark=spark, dsn=pg_dsn)

    # Window 2 is computed and staged; then a DBA renames a column; then it commits.
    write_orders(landing, ["orders-002.csv"])
    fault = {**env, "ONCEFLOW_FAULT": "pg_staged@2:stop"}
    run = CliRun(["run", JOB], fault, home / "logs", cwd=project)
    try:
        _stopped(run.pid)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE public.orders RENAME COLUMN customer TO client")
        os.kill(run.pid, signal.SIGCONT)
        refused = run.finish()
    finally:
        run.kill_group()
    assert refused.returncode == 1, refused.stderr[-3000:]
    fix = 'ALTER TABLE "public"."orders" RENAME COLUMN "client" TO "customer"'
    message = refused.stderr.strip().splitlines()[-1]
    assert "PostgreSQL refused window 2 (UndefinedColumn, SQLSTATE 42703" in message, message
    assert "table public.orders has no column customer (declared text)" in message
    assert fix in message and "nothing was written" in message
    assert "Alice" not in refused.stderr and "Grace" not in refused.stderr

    # The next run refuses before computing anything, with the same fix.
    again = onceflow(["run", JOB], env, project, rc=1)
    assert fix in again.stderr and "Nothing was computed or written" in again.stderr
    assert "window 2" not in again.stdout

    # The migration note applied: the run completes, each record exactly once.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(fix)
    with user_project_on_path() as user:
        ops.run(user.ORDERS, settings, spark=spark, dsn=pg_dsn)
    assert_orders_exact(pg_dsn, [["orders-001.csv"], ["orders-002.csv"]])


# A user's variant of the README job, the window id added after a `select` as the docs
# suggest; and a job of theirs whose code fails on the executors.
VARIANTS = """
from pyspark.sql import functions as F

from onceflow import CsvSource, Job, PostgresSink
from orders_jobs import ORDERS
import dataclasses


def with_window_column(rows, ctx):
    picked = rows.select(
        "order_id",
        F.lower(F.trim("customer")).alias("customer"),
        "amount_cents",
        "ordered_at",
    )
    return {"orders": picked.withColumn("window_id", ctx.window_id_column())}


ORDERS_WINDOW_COLUMN = dataclasses.replace(ORDERS, transform=with_window_column)


def _boom(value):
    raise ValueError("the user's own bug")


def failing(rows, ctx):
    return {"out": rows.select("order_id", F.udf(_boom, "string")("customer").alias("customer"))}


FAILING = Job(
    name="orders_failing",
    source=CsvSource("orders_failing", schema=ORDERS.source.schema),
    transform=failing,
    sinks=(PostgresSink("pg_orders_failing", "out", table="orders_failing",
                        columns={"order_id": "text", "customer": "text"}),),
)
"""


def _only_onceflow_lines(stderr: str) -> None:
    """Every line on the terminal is onceflow's own: its messages and its log's warnings."""
    for line in stderr.strip().splitlines():
        assert line.startswith("onceflow: ") or " WARNING onceflow" in line, stderr[-4000:]


def test_window_id_column_after_a_select_and_spark_logs_off_the_terminal(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    (project / "orders_variants.py").write_text(VARIANTS)
    home = tmp_path / "home"
    env = _env(home, pg_dsn, lake, landing, ONCEFLOW_JOBS="orders_variants:ORDERS_WINDOW_COLUMN")
    write_orders(landing)
    run = onceflow(["run", JOB, "--max-files-per-window", "1"], env, project)
    assert "3 window(s)" in run.stdout
    assert run.stderr == "", run.stderr
    assert_orders_exact(pg_dsn, one_file_per_window())

    # A transform that fails on the executors: no Spark log on the terminal; it is in a file.
    (landing / "orders_failing").mkdir()
    shutil.copy(landing / "orders" / "orders-001.csv", landing / "orders_failing")
    failing_env = {**env, "ONCEFLOW_JOBS": "orders_variants:FAILING"}
    failed = onceflow(["run", "orders_failing"], failing_env, project, rc=1)
    _only_onceflow_lines(failed.stderr)
    last = failed.stderr.strip().splitlines()[-1]
    assert "the job's code raised ValueError on an executor at orders_variants.py" in last, last
    assert "in _boom" in last and "own bug" not in last
    assert f"Spark's log: {home / 'logs' / 'spark.log'}" in last
    spark_log = (home / "logs" / "spark.log").read_text()
    assert "the user's own bug" in spark_log  # the executor's error, where the message says

    # ONCEFLOW_DEBUG=1: the whole traceback, down to the user's own frame on the executor.
    debug = onceflow(["run", "orders_failing"], {**failing_env, "ONCEFLOW_DEBUG": "1"}, project,
                     rc=1)  # fmt: skip
    assert "Traceback (most recent call last):" in debug.stderr
    assert "in _boom" in debug.stderr and "the user's own bug" in debug.stderr


@pytest.fixture()
def embedded_home() -> Iterator[Path]:
    """An ONCEFLOW_HOME for the embedded server (readable by the user pgserver runs it as);
    whatever server is left there is stopped afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="onceflow-embedded-"))
    folder.chmod(0o755)
    yield folder / "home"
    pid_file = folder / "home" / "postgres" / "postmaster.pid"
    if pid_file.exists():
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
    shutil.rmtree(folder, ignore_errors=True)


def _server_stops(data: Path, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (data / "postmaster.pid").exists():
            return True
        time.sleep(0.2)
    return False


def test_status_into_a_closed_pipe_ends_quietly_and_stops_the_embedded_server(
    embedded_home: Path, lake: Path, landing: Path, project: Path
) -> None:
    env = _env(embedded_home, "", lake, landing)
    env.pop("ONCEFLOW_POSTGRES_DSN")  # the embedded server under ONCEFLOW_HOME
    data = embedded_home / "postgres"
    (landing / "orders").mkdir()

    # A run killed outright (SIGKILL: no exit handlers) while it holds the embedded server.
    held = subprocess.Popen(
        [ONCEFLOW, "run", JOB, "--follow"], env=env, cwd=project, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while held.pid not in _holders(data):
            assert time.monotonic() < deadline, "the run never started the embedded server"
            assert held.poll() is None, held.communicate()[1]
            time.sleep(0.2)
    finally:
        os.killpg(held.pid, signal.SIGKILL)
        held.communicate()
    assert (data / "postmaster.pid").exists()

    for args in (["status", JOB, "--json"], ["status", JOB]):
        status = subprocess.Popen(
            [ONCEFLOW, *args], env=env, cwd=project, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert status.stdout is not None
        status.stdout.close()  # the reader is gone before anything is written (`| head`)
        _, err = status.communicate(timeout=RUN_TIMEOUT_S)
        assert err.decode() == "", err.decode()
        assert status.returncode == 141
        assert _server_stops(data), f"the embedded server still runs; holders {_holders(data)}"


def _holders(data: Path) -> list[int]:
    try:
        return [int(p) for p in json.loads((data / ".handle_pids.json").read_text())]
    except (OSError, ValueError):
        return []
