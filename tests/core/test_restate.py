"""Restating a window replaces exactly its effect in every sink, once per request."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow.engine import Engine
from onceflow.generate import generate_payments
from onceflow.job import WindowContext
from onceflow.jobs.payments import transform_payments
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from tests.support.oracle import expected_outputs, visible_files
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
