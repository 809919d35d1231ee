"""The command line as another orchestrator drives it: `onceflow recover`, `--run-id`, one JSON
object on stdout (`--json`), and exit codes that tell a retryable failure from a terminal one.
Each process starts a JVM: few of them."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from onceflow import ops
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.ops import EXIT_FAILED, EXIT_NEEDS_RECOVERY, EXIT_OK
from onceflow.settings import Settings
from tests.core.test_lost_lake import assert_postgres_consistent
from tests.support.cli import CliRun, cli_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.slow


# make test-all: `recover --json` is in CI through the exit-5 test below and the Airflow
# provider's recover task after a failed run.
@pytest.mark.exhaustive
def test_recover_json_after_a_killed_run_is_exact(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    generate_payments(landing, records=1200, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    home = tmp_path / "home"

    def cli(*args: str, fault: str | None = None) -> CliRun:
        env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing, fault=fault)
        return CliRun(list(args), env, home / "logs")

    # Killed between the Delta commit and PostgreSQL's for window 2.
    run = ["run", "payments", "--max-files-per-window", "2"]
    crashed = cli(*run, fault="pg_commit_sent@2").finish()
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]

    done = cli("recover", "payments", "--json", "--run-id", "rec-1").finish()
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    result = json.loads(done.stdout)  # stdout is the one JSON object; logs went to stderr
    assert (result["operation"], result["job"], result["run_id"]) == (
        "recover",
        "payments",
        "rec-1",
    )
    assert result["ok"] is True and result["incomplete"] == {}
    assert result["windows_replayed"][-1] == 3  # window 3's input was never planned before
    assert result["reconcile"]["clean"] is True
    for window in result["replayed"]:
        for sink in window["sinks"]:
            assert sink["committed"] or sink["already_committed"]
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

    checked = cli("validate", "payments", "--json").finish()
    assert checked.returncode == EXIT_OK, checked.stderr[-2000:]
    report = json.loads(checked.stdout)
    assert report["passed"] is True and report["through_window"] == 3
    assert {c["sink"] for c in report["checks"]} >= {"lake_payments", "pg_payments"}


def test_a_terminal_failure_exits_1_not_75(
    pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    (landing / "payments").mkdir(parents=True)
    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    # No Spark: a skip of a window never planned is refused, and retrying cannot help.
    args = ["windows", "skip", "payments", "9", "--reason", "gone", "--run-id", "s-1", "--json"]
    refused = CliRun(args, env, home / "logs").finish()
    assert refused.returncode == EXIT_FAILED, refused.stderr[-2000:]
    assert "window 9 was never planned" in refused.stderr
    failure = json.loads(refused.stdout)
    assert failure["error"] == "ConfigurationError" and failure["retryable"] is False
    assert "window 9 was never planned" in failure["message"]


def test_a_sink_that_lost_its_table_exits_5_and_recover_makes_it_exact(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """Windows 1-2 committed (in-process), then the Delta table's folder deleted and more input
    landed: `run --json` refuses with exit 5 (needs recovery: running it again fails the same
    way) and its JSON, writing nothing; `recover --json` exits 0 and the sinks end exact."""
    source = tmp_path / "input"
    generate_payments(source, records=1200, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    files = sorted((source / "payments").iterdir())
    (landing / "payments").mkdir(parents=True)

    def land(paths: list[Path]) -> None:
        for path in paths:
            shutil.copy2(path, landing / "payments" / path.name)

    land(files[:4])
    home = tmp_path / "home"
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    first = ops.run(PAYMENTS, settings, spark=spark, dsn=pg_dsn, max_units_per_window=2)
    assert [w.window_id for w in first.committed] == [1, 2]
    shutil.rmtree(lake / "payments")  # the lake_payments table, from outside
    land(files[4:])
    before = actual_outputs(pg_dsn, lake)

    def cli(*args: str) -> Any:
        env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
        return CliRun(list(args), env, home / "logs").finish()

    refused = cli("run", "payments", "--json")
    assert refused.returncode not in (EXIT_OK, -signal.SIGKILL), refused.stderr[-2000:]
    assert "lake_payments lacks windows 1-2" in refused.stderr, refused.stderr[-2000:]
    failure = json.loads(refused.stdout)
    assert (failure["operation"], failure["ok"]) == ("run", False)
    assert failure["exit_code"] == refused.returncode and failure["retryable"] is False
    after = actual_outputs(pg_dsn, lake)
    for rows in ("pg_payments", "balances", "quarantine"):  # the refused run wrote nothing
        assert sorted(map(repr, getattr(after, rows))) == sorted(map(repr, getattr(before, rows)))
    assert_postgres_consistent(after)

    done = cli("recover", "payments", "--json")
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["ok"] is True and result["incomplete"] == {}
    assert result["reconcile"]["clean"] is True
    # Nothing lost, nothing doubled: every sink equals the oracle over all the input.
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

    assert refused.returncode == EXIT_NEEDS_RECOVERY == 5
    assert failure["error"] == "SinkStateError" and failure["needs_recovery"] is True
