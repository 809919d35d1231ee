"""Restating a window replaces exactly its effect in every sink, once per request."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import ops
from onceflow.engine import Engine
from onceflow.errors import SinkError
from onceflow.generate import generate_payments
from onceflow.job import WindowContext
from onceflow.jobs.payments import transform_payments
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from onceflow.status import format_status, job_status
from tests.support.cli import TEST_JVM_ENV, CliRun
from tests.support.flat_fee_payments import FLAT_FEE
from tests.support.oracle import Expected, expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact


def _flat_fee(valid: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return transform_payments(valid.withColumn("amount_cents", F.lit(1).cast("bigint")), ctx)


def test_restate_replaces_one_windows_effect(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=1200, files=4, duplicate_rate=0.2, invalid_rate=0.1, seed=5)
    files = visible_files(landing)
    job = get_job("payments")
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    expected = expected_outputs(landing, windows=[files[:2], files[2:]])

    # Same transform: nothing changes, and a retry of the same request is a no-op.
    engine = Engine(job, settings, spark, pg_dsn)
    [first] = restate_windows(engine, [1], request_id="same")
    assert first.sinks and all(s.committed for s in first.sinks.values())
    [again] = restate_windows(engine, [1], request_id="same")
    assert again.noop  # the request was applied once; its retry changes nothing
    assert_exact(expected, actual_outputs(pg_dsn, lake))

    # A new transform for window 1 only: its payments and its share of every balance change.
    changed = Engine(dataclasses.replace(job, transform=_flat_fee), settings, spark, pg_dsn)
    restate_windows(changed, [1], request_id="flat")
    window_1 = set(files[:2])
    payments = {
        pid: (*row[:3], 1, *row[4:]) if row[6] in window_1 else row
        for pid, row in expected.payments.items()
    }
    balances: dict[tuple[str, str], tuple[int, int]] = {}
    for row in payments.values():
        total, count = balances.get((row[1], row[4]), (0, 0))
        balances[(row[1], row[4])] = (total + row[3], count + 1)
    assert_exact(
        dataclasses.replace(expected, payments=payments, balances=balances),
        actual_outputs(pg_dsn, lake),
    )


REPO = Path(__file__).resolve().parents[2]


def _cli_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env.update(
        ONCEFLOW_HOME=str(settings.home),
        ONCEFLOW_POSTGRES_DSN=str(settings.postgres_dsn),
        ONCEFLOW_LAKE=str(settings.lake),
        ONCEFLOW_LANDING=str(settings.landing),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **TEST_JVM_ENV,
        **extra,
    )
    return env


def _flat_fee_expected(expected: Expected, files: set[str]) -> Expected:
    """The oracle with every payment of `files` at one cent, balances summed again."""
    payments = {
        pid: (*row[:3], 1, *row[4:]) if row[6] in files else row
        for pid, row in expected.payments.items()
    }
    balances: dict[tuple[str, str], tuple[int, int]] = {}
    for row in payments.values():
        total, count = balances.get((row[1], row[4]), (0, 0))
        balances[(row[1], row[4])] = (total + row[3], count + 1)
    return dataclasses.replace(expected, payments=payments, balances=balances)


@pytest.mark.slow
@pytest.mark.parametrize("finished_by", ["retry_with_a_new_run_id", "next_run"])
def test_range_restatement_killed_midway_changes_every_window_once(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, finished_by: str
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=1800, files=8, duplicate_rate=0.2, invalid_rate=0.1, seed=7)
    files = visible_files(landing)
    job = get_job("payments")
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)  # windows 1-4
    expected = expected_outputs(landing, windows=[files[i : i + 2] for i in range(0, 8, 2)])
    logs = tmp_path / "logs"
    flat = {"ONCEFLOW_JOBS": "tests.support.flat_fee_payments:FLAT_FEE"}
    restate = ["restate", "payments", "--windows", "1-3", "--request-id", "fees-2026"]

    # Killed after window 2 changed in every sink, before the ledger learnt it.
    killed = CliRun(restate, _cli_env(settings, ONCEFLOW_FAULT="restated@2", **flat), logs)
    crashed = killed.finish()
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    status = job_status(Engine(job, settings, None, pg_dsn))
    assert [r["window_id"] for r in status["restatements_pending"]] == [2, 3]
    assert "restatements not finished: window 2" in format_status(status)

    # The rest in-process, on the session's Spark: the property is the killed process above;
    # what finishes it is the same whoever calls it (the CLI only prints the results).
    if finished_by == "next_run":
        ops.run(FLAT_FEE, settings, spark=spark, dsn=pg_dsn)
    else:  # a retry of the request with a new run id, as the CLI gives one
        ops.restate(FLAT_FEE, [1, 2, 3], settings, spark=spark, dsn=pg_dsn, request_id="fees-2026")
    assert job_status(Engine(job, settings, None, pg_dsn))["restatements_pending"] == []
    assert_exact(_flat_fee_expected(expected, set(files[:6])), actual_outputs(pg_dsn, lake))

    # And once more: the request is done, so nothing changes. One variant asks through the
    # command, whose lines say so for each window.
    if finished_by == "next_run":
        again = CliRun(restate, _cli_env(settings, **flat), logs).finish()
        assert again.returncode == 0, again.stderr[-2000:]
        assert again.stdout.count("this request already restated it; nothing changed") == 3
    else:
        done = ops.restate(
            FLAT_FEE, [1, 2, 3], settings, spark=spark, dsn=pg_dsn, request_id="fees-2026"
        )
        assert done.noop_windows == (1, 2, 3), done
    assert_exact(_flat_fee_expected(expected, set(files[:6])), actual_outputs(pg_dsn, lake))


def test_a_restatement_that_cannot_finish_changes_nothing(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=900, files=4, duplicate_rate=0.1, invalid_rate=0.1, seed=8)
    job = get_job("payments")
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    with psycopg.connect(pg_dsn) as conn:  # window 2's balance contribution is lost
        conn.execute("DELETE FROM onceflow.window_contributions WHERE window_id = 2")
    before = actual_outputs(pg_dsn, lake)

    changed = Engine(dataclasses.replace(job, transform=_flat_fee), settings, spark, pg_dsn)
    with pytest.raises(SinkError, match="window 2's contribution is not on record"):
        restate_windows(changed, [1, 2], request_id="half")
    after = actual_outputs(pg_dsn, lake)
    assert sorted(after.delta_payments) == sorted(before.delta_payments)
    assert sorted(after.pg_payments) == sorted(before.pg_payments)
    assert sorted(after.balances) == sorted(before.balances)
