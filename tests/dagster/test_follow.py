"""The follow run on a real instance, Spark, PostgreSQL and Delta: files landing while it runs
are committed exactly once and reported per window; it makes way for another run of the job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRun, DagsterRunStatus

import definitions
from assets.config import delivery
from onceflow.errors import ConfigurationError
from onceflow.generate import generate_payments
from onceflow.lineage import lineage
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.dagster

SINKS = {"lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine"}


@pytest.fixture()
def instance(disk_instance: DagsterInstance) -> DagsterInstance:
    return disk_instance  # runs are added from a second thread while a run executes


def _land(landing: Path, seed: int) -> None:
    generate_payments(
        landing, records=200, files=1, duplicate_rate=0.1, invalid_rate=0.05, seed=seed
    )


def _later(when: Callable[[], bool], then: Callable[[], None], timeout_s: float = 240) -> list:
    """Run `then` on a thread once `when` holds; the list receives any error."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            deadline = time.monotonic() + timeout_s
            while not when():
                if time.monotonic() > deadline:
                    raise TimeoutError("condition never held")
                time.sleep(0.2)
            then()
        except BaseException as exc:
            errors.append(exc)

    threading.Thread(target=body, daemon=True).start()
    return errors


def _windows_committed(pg_dsn: str) -> int:
    import psycopg

    with psycopg.connect(pg_dsn) as conn:
        if conn.execute("select to_regclass('onceflow.windows')").fetchone()[0] is None:
            return 0  # the run has not made its ledger yet
        row = conn.execute(
            "select count(*) from onceflow.windows where job = 'payments' and completed_at is not null"
        ).fetchone()
    return int(row[0])


def test_follow_run_commits_files_as_they_land_and_reports_each_window(
    resources: dict, instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    defs = definitions.build_defs(resources)
    follow = defs.resolve_job_def("payments_follow_job")
    _land(landing, 1)
    # Two more files land one by one while the run follows, each after the one before is in.
    second = _later(lambda: _windows_committed(pg_dsn) >= 1, lambda: _land(landing, 2))
    third = _later(lambda: _windows_committed(pg_dsn) >= 2, lambda: _land(landing, 3))
    result = follow.execute_in_process(
        instance=instance,
        run_config={
            "ops": {
                "payments_follow": {
                    "config": {"stop_after_idle_s": 8, "check_every_s": 0.1, "poll_interval_s": 0.2}
                }
            }
        },
    )
    assert result.success
    assert instance.get_run_by_id(result.run_id).tags["onceflow/follow_end"] == "idle"
    assert not second and not third, second + third
    assert _windows_committed(pg_dsn) == 3
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

    mats = result.asset_materializations_for_node("payments_follow")
    by_sink: dict[str, list] = {}
    for mat in mats:
        by_sink.setdefault(mat.asset_key.to_user_string(), []).append(mat)
    assert set(by_sink) == SINKS
    for sink, events in by_sink.items():
        # One materialisation per window, in order, each with its own window's metadata.
        assert [e.metadata["window_first"].value for e in events] == [1, 2, 3], sink
        assert all(e.metadata["windows_committed"].value == 1 for e in events)
        assert all(e.metadata["mode"].value == "follow" for e in events)
        assert "lineage" in events[-1].metadata
    lake_versions = [int(e.tags["dagster/data_version"]) for e in by_sink["lake_payments"]]
    assert lake_versions == sorted(lake_versions) and len(set(lake_versions)) == 3
    rows = sum(e.metadata["rows_in"].value for e in by_sink["pg_payments"])
    assert rows == 3 * (200 + 20 + 10)  # per file: payments, 10% duplicates, 5% invalid

    checks = [
        e.event_specific_data
        for e in result.all_events
        if e.event_type == DagsterEventType.ASSET_CHECK_EVALUATION
    ]
    # Every check of every asset it materialised, not only the quality suites.
    declared = {
        (k.asset_key.to_user_string(), k.name)
        for k in defs.resolve_asset_graph().asset_check_keys
        if k.asset_key.to_user_string() in SINKS
    }
    assert {(c.asset_key.to_user_string(), c.check_name) for c in checks} == declared
    assert {name for _, name in declared} == {"quality", "input_planned_in_time"}
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    # The lineage follows the checks: the quality result covers the newest window, and the
    # lineage table, written when the window committed, claims nothing about checks.
    quality = [c for c in checks if c.check_name == "quality"]
    assert quality[-1].metadata["through_window"].value == 3
    for sink, events in by_sink.items():
        table = events[-1].metadata["lineage"].value
        assert "checks" not in {c.name for c in table.schema.columns}, sink
        assert "not checked" not in str(table.records), sink
    (newest, *_) = lineage(pg_dsn, "payments")
    assert newest.window_id == 3 and newest.checks_passed is True
    # The quality sensor reads check executions from the instance: they must be recorded.
    record = instance.event_log_storage.get_asset_check_execution_history(
        checks[0].asset_check_key, limit=5
    )
    assert record and record[0].run_id == result.run_id


@pytest.mark.parametrize(
    "waiting",
    [
        # A backfill or restatement launched from the launchpad, about to start.
        DagsterRun(job_name="payments_job", status=DagsterRunStatus.NOT_STARTED),
        # "Materialize" on the asset graph: no job, no job tag; its step waits for the pool.
        DagsterRun(
            job_name="__ASSET_JOB",
            status=DagsterRunStatus.STARTED,
            asset_selection=frozenset({AssetKey("pg_merchant_balances")}),
        ),
    ],
    ids=["job_run", "asset_graph_run"],
)
def test_follow_run_makes_way_for_a_waiting_run_of_the_job(
    waiting: DagsterRun,
    resources: dict,
    instance: DagsterInstance,
    pg_dsn: str,
    lake: Path,
    landing: Path,
) -> None:
    defs = definitions.build_defs(resources)
    follow = defs.resolve_job_def("payments_follow_job")
    _land(landing, 1)
    added = _later(lambda: _windows_committed(pg_dsn) >= 1, lambda: instance.add_run(waiting))
    started = time.monotonic()
    # Never idle-stops: only the waiting run ends it.
    result = follow.execute_in_process(
        instance=instance,
        run_config={"ops": {"payments_follow": {"config": {"check_every_s": 0}}}},
    )
    assert result.success and not added
    assert time.monotonic() - started < 120
    logs = "\n".join(e.user_message for e in instance.all_logs(result.run_id))
    assert f"run {waiting.run_id} of payments is waiting: making way" in logs
    # The new-data sensor reads this to start the next follow run once the other has run.
    assert instance.get_run_by_id(result.run_id).tags["onceflow/follow_end"] == "made_way"
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_follow_is_the_default_delivery_and_a_bad_one_fails_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONCEFLOW_DELIVERY", raising=False)
    assert delivery() == "follow"
    sensor = definitions.defs.get_sensor_def("payments_new_data_sensor")
    assert sensor.job_name == "payments_follow_job"
    monkeypatch.setenv("ONCEFLOW_DELIVERY", "runs")
    assert definitions.build_defs().get_sensor_def("payments_new_data_sensor").job_name == (
        "payments_job"
    )
    monkeypatch.setenv("ONCEFLOW_DELIVERY", "stream")
    with pytest.raises(ConfigurationError, match="ONCEFLOW_DELIVERY='stream' is not a delivery"):
        definitions.build_defs()


def test_a_downstream_job_follows_the_table_it_reads(
    resources: dict, instance: DagsterInstance, pg_dsn: str, lake: Path, landing: Path
) -> None:
    """daily_totals reads the payments Delta table by version: its follow run takes each new
    version as the payments follow run commits it."""
    from tests.support.daily_totals_oracle import assert_totals_exact, totals_from_landing

    defs = definitions.build_defs(resources)
    payments = defs.resolve_job_def("payments_follow_job")
    totals = defs.resolve_job_def("daily_totals_follow_job")
    config = {"stop_after_idle_s": 6, "check_every_s": 0, "poll_interval_s": 0.2}
    _land(landing, 1)
    done: list = []

    def follow_payments() -> None:
        try:
            done.append(
                payments.execute_in_process(
                    instance=instance, run_config={"ops": {"payments_follow": {"config": config}}}
                )
            )
        except BaseException as exc:
            done.append(exc)

    upstream = threading.Thread(target=follow_payments, daemon=True)
    upstream.start()
    second = _later(lambda: _windows_committed(pg_dsn) >= 1, lambda: _land(landing, 2))
    result = totals.execute_in_process(
        instance=instance,
        run_config={
            "ops": {"daily_totals_follow": {"config": {**config, "stop_after_idle_s": 20}}}
        },
    )
    upstream.join(300)
    assert done and not isinstance(done[0], BaseException), done
    assert done[0].success and result.success and not second
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert_totals_exact(totals_from_landing(landing), pg_dsn, "daily_totals follow run")
    mats = result.asset_materializations_for_node("daily_totals_follow")
    assert mats and all(m.metadata["mode"].value == "follow" for m in mats)
