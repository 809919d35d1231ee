"""`onceflow.ops` in-process on the session's Spark: what each operation returns, a recovery
after a real killed run, and a run id given twice being one request."""

from __future__ import annotations

import ast
import json
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.errors import (
    CommitUnknownError,
    ConfigurationError,
    FencedError,
    PostgresUnavailableError,
    SinkStateError,
)
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.settings import Settings
from tests.core.test_structure import PRESENTER_IMPORTS, _core_imports
from tests.support.cli import REPO, CliRun, cli_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

# What only `onceflow.ops` calls: the engine's operations and the functions behind them.
_ENGINE_OPERATIONS = {"run", "backfill", "recover", "skip", "restate", "replay_lacking"}
_OPERATION_FUNCTIONS = {"restate_windows", "validate_job", "job_status", "reconcile"}
_CLI = REPO / "platform" / "onceflow" / "cli"


def _settings(tmp_path: Path, dsn: str, lake: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path / "home", postgres_dsn=dsn, lake=lake, landing=landing)


def _restatements(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT window_id, request_id FROM onceflow.restatements WHERE job = 'payments'"
            " ORDER BY seq"
        ).fetchall()
    return [(int(w), str(r)) for w, r in rows]


@pytest.mark.slow
def test_run_result_and_a_run_id_given_twice_is_one_request(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    generate_payments(landing, records=800, files=4, duplicate_rate=0.1, invalid_rate=0.05)
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    options: dict[str, Any] = {"spark": spark, "dsn": pg_dsn}

    done = ops.run(PAYMENTS, settings, run_id="r-1", max_units_per_window=2, **options)
    assert (done.kind, done.job, done.run_id) == ("run", "payments", "r-1")
    assert done.epoch is not None and done.epoch >= 1
    assert [w.window_id for w in done.windows] == [1, 2]
    for window in done.windows:
        assert len(window.offsets["files"]) == 2 and window.stats["rows_in"] > 0
        lake_sink, pg_sink = window.sink("lake_payments"), window.sink("pg_payments")
        assert lake_sink is not None and lake_sink.committed and lake_sink.rows > 0
        assert isinstance(lake_sink.data_version, int)  # the Delta version holding it
        assert pg_sink is not None and pg_sink.committed and pg_sink.commit_ref  # its xid
    as_json = json.loads(json.dumps(done.as_json()))
    assert as_json["windows_committed"] == [1, 2] and as_json["rows_written"] > 0
    expected = expected_outputs(landing)
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    # The same run id again: nothing new, nothing committed twice.
    again = ops.run(PAYMENTS, settings, run_id="r-1", **options)
    assert again.windows == ()
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    # A restatement retried with its run id restates each window once.
    first = ops.restate(PAYMENTS, [1], settings, run_id="fix-1", **options)
    assert first.request_id == "fix-1" and [w.window_id for w in first.committed] == [1]
    retried = ops.restate(PAYMENTS, [1], settings, run_id="fix-1", **options)
    assert retried.committed == () and retried.noop_windows == (1,)
    assert _restatements(pg_dsn) == [(1, "fix-1/w1")]
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    # A backfill of windows every sink holds changes nothing, however often it is asked.
    for _ in range(2):
        backfilled = ops.backfill(PAYMENTS, [1, 2], settings, run_id="bf-1", **options)
        assert backfilled.windows == () and backfilled.noop_windows == (1, 2)
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    status = ops.status(PAYMENTS, settings, dsn=pg_dsn).as_json()
    assert status["last_window"] == 2
    json.dumps(status, default=str)


@pytest.mark.slow
def test_recover_after_a_killed_run_is_exact(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    generate_payments(landing, records=1200, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing, fault="after_delta@2")
    args = ["run", "payments", "--max-files-per-window", "2"]
    crashed = CliRun(args, env, home / "logs").finish()
    # Killed with window 2 committed to the Delta table only, window 3 not planned.
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    options: dict[str, Any] = {"spark": spark, "dsn": pg_dsn}

    result = ops.recover(PAYMENTS, settings, run_id="rec-1", reconcile="full", **options)
    replayed = {w.window_id: w for w in result.replayed}
    assert sorted(replayed) == [2, 3] and not any(w.noop for w in replayed.values())
    window_2 = replayed[2]
    lake_2, pg_2 = window_2.sink("lake_payments"), window_2.sink("pg_payments")
    assert lake_2 is not None and lake_2.already_committed and not lake_2.committed
    assert pg_2 is not None and pg_2.committed
    assert result.ok and result.incomplete == {} and result.verified == (1, 2, 3)
    assert result.reconcile is not None and result.reconcile.clean
    assert json.loads(json.dumps(result.as_json()))["windows_replayed"] == [2, 3]
    expected = expected_outputs(landing)
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    # Recovering again with the same run id finds nothing to do.
    again = ops.recover(PAYMENTS, settings, run_id="rec-1", reconcile="off", **options)
    assert again.replayed == () and again.ok and again.reconcile is None
    assert_exact(expected, actual_outputs(pg_dsn, lake))


def test_exit_codes_tell_retryable_from_recoverable_from_terminal() -> None:
    assert ops.exit_code(PostgresUnavailableError("down")) == ops.EXIT_RETRYABLE == 75
    assert ops.exit_code(CommitUnknownError("unanswered")) == ops.EXIT_RETRYABLE
    assert ops.exit_code(SinkStateError("lost")) == ops.EXIT_NEEDS_RECOVERY
    assert ops.exit_code(FencedError("newer run")) == ops.EXIT_FENCED
    assert ops.exit_code(ConfigurationError("wrong")) == ops.EXIT_FAILED
    assert ops.exit_code(RuntimeError("unknown")) == ops.EXIT_FAILED


def test_the_cli_and_the_dagster_layer_only_present_ops() -> None:
    """Neither the CLI nor the Dagster layer runs an operation itself: a second orchestrator
    gets the same behaviour from `onceflow.ops` without copying either."""
    files = [*sorted(_CLI.glob("*.py")), *sorted((REPO / "assets").glob("*.py"))]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            on_engine = (
                isinstance(func, ast.Attribute)
                and func.attr in _ENGINE_OPERATIONS
                and isinstance(func.value, ast.Name)
                and func.value.id == "engine"
            )
            if on_engine or (isinstance(func, ast.Name) and func.id in _OPERATION_FUNCTIONS):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == [], f"operations run outside onceflow.ops: {found}"


def test_the_cli_package_imports_only_onceflow_ops_and_its_own_modules() -> None:
    """Each of the CLI's modules reaches the core through `onceflow` and `onceflow.ops` only;
    its own modules (`onceflow.cli.*`) are the presenter's, not the core's."""
    found: list[str] = []
    seen = 0
    for path in sorted(_CLI.glob("*.py")):
        module = "onceflow.cli" + ("" if path.stem == "__init__" else f".{path.stem}")
        for line, name in _core_imports(ast.parse(path.read_text()), module):
            seen += 1
            if name not in PRESENTER_IMPORTS and not name.startswith("onceflow.cli"):
                found.append(f"cli/{path.name}:{line} imports {name}")
    assert seen > 10  # the walk found the package's imports
    assert found == [], "import the name from `onceflow` or `onceflow.ops` instead: " + str(found)
