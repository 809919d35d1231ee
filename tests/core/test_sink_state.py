"""A sink proves the windows it holds: a Delta table deleted, replaced by an older copy or
recreated — between runs or under a live `run --follow` — is never refilled from the middle
and reported complete; restatements a restored copy lost are found; a window reconcile cannot
put back leaves every later one lacking too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.engine import Engine
from onceflow.errors import LedgerError, OnceflowError, SinkStateError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.reconcile import reconcile
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from tests.core.test_lost_lake import Landing, assert_postgres_consistent
from tests.support.cli import CliRun, cli_env
from tests.support.follow import wait_completed
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    # An older copy under a live run is also covered in-process (the snapshot test below).
    ["deleted", pytest.param("older_copy", marks=pytest.mark.exhaustive)],
)
def test_a_lake_lost_under_a_live_follow_run_stops_it_and_reconcile_makes_it_exact(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path, damage: str
) -> None:
    """`run --follow` commits the first windows; the lake is deleted (or replaced by an older
    copy) while it waits; more files land. The follow run must stop with an error naming
    reconcile, never commit into a table made anew; the next `run` refuses; `reconcile`, then
    `run`, end exact. PostgreSQL stays consistent at every step. The follow run and reconcile
    are real CLI processes; the runs after them in-process on the session's Spark (`ops.run`,
    what the CLI's `run` presents; its refusal's exit code: test_cli.py)."""
    source = tmp_path / "input"
    generate_payments(source, records=2400, files=8, duplicate_rate=0.25, invalid_rate=0.05)
    files = sorted((source / "payments").iterdir())
    (landing / "payments").mkdir(parents=True)

    def land(upto: int) -> None:
        for path in files[:upto]:
            target = landing / "payments" / path.name
            if not target.exists():
                tmp = target.with_suffix(".tmp")
                shutil.copy2(path, tmp)
                tmp.rename(target)

    home = tmp_path / "home"
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing)
    land(2)
    follow = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "run", "payments", "--follow",
         "--poll-interval", "0.3", "--max-files-per-window", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_completed(pg_dsn, 1, follow)
        backup = tmp_path / "lake-backup"
        shutil.copytree(lake, backup)  # holds window 1 at least
        land(4)
        wait_completed(pg_dsn, 4, follow)
        shutil.rmtree(lake)
        if damage == "older_copy":
            shutil.copytree(backup, lake)
        land(8)
        # It stops by itself at the next window: no SIGTERM, which would end it cleanly.
        _, err = follow.communicate(timeout=240)
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
    assert follow.returncode not in (0, -signal.SIGKILL), err[-3000:]
    assert "onceflow reconcile payments" in err, err[-3000:]
    assert_postgres_consistent(actual_outputs(pg_dsn, lake))

    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    with pytest.raises(OnceflowError) as rerun:
        ops.run(PAYMENTS, settings, spark=spark, dsn=pg_dsn)
    assert ops.exit_code(rerun.value) != ops.EXIT_OK
    assert "onceflow reconcile payments" in rerun.value.message, rerun.value.message
    assert_postgres_consistent(actual_outputs(pg_dsn, lake))

    fixed = CliRun(["reconcile", "payments"], env, home / "logs").finish()
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    ops.run(PAYMENTS, settings, spark=spark, dsn=pg_dsn, max_units_per_window=2)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def _settings(tmp_path: Path, pg_dsn: str, lake: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)


def test_a_table_created_again_between_runs_is_not_taken_for_the_one_recorded(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """The lake deleted and an empty table made at the same path by another tool, claiming
    (by its app transaction) to hold windows 1–2: it is not the table onceflow recorded, so it
    holds none of them; the run refuses, reconcile adopts it and puts the windows back."""
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(4)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    # A table at the same path that claims to hold windows through 2, made outside onceflow.
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    path = lake / "payments"
    schema = DeltaTable(str(path)).schema().to_arrow()
    shutil.rmtree(path)
    import pyarrow as pa

    write_deltalake(
        str(path),
        pa.Table.from_batches([], schema=pa.schema(schema)),
        commit_properties=CommitProperties(
            app_transactions=[Transaction("onceflow/payments/lake_payments", 2)]
        ),
    )
    engine = Engine(job, settings, spark, pg_dsn)
    assert engine.lacking_windows() == {"lake_payments": [1, 2]}
    data.land(6)
    with pytest.raises(SinkStateError, match="onceflow reconcile payments"):
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)

    report = reconcile(Engine(job, settings, spark, pg_dsn))
    assert report.replayed == {"lake_payments": [1, 2]}, report
    assert report.clean or report.sinks, report
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert_exact(data.expected_for(6), actual_outputs(pg_dsn, lake))


def test_a_restored_copy_that_lost_a_restatement_is_refused_until_reconciled(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """The lake restored from a copy taken before a restatement holds every window, but not
    the restatement: the run refuses (naming reconcile) instead of going on over the old rows;
    reconcile puts the restated rows back and records the restatement as applied."""
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(4)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    backup = tmp_path / "lake-backup"
    shutil.copytree(lake, backup)
    restate_windows(Engine(job, settings, spark, pg_dsn), [1], request_id="r-1")
    shutil.rmtree(lake)
    shutil.copytree(backup, lake)

    engine = Engine(job, settings, spark, pg_dsn)
    assert engine.lacking_windows() == {}
    data.land(6)
    with pytest.raises(SinkStateError) as refused:
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert "restatements through 0" in refused.value.message
    assert "onceflow reconcile payments" in refused.value.message

    reconcile(Engine(job, settings, spark, pg_dsn))
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert_exact(data.expected_for(6), actual_outputs(pg_dsn, lake))


def test_a_commit_on_a_table_restored_mid_run_is_refused_on_its_snapshot(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """The check is made on the snapshot the commit is made against: a table restored from an
    older copy after the run started (past its start-up checks) refuses the next window."""
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(2)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    # The table alone: the run's own stages under the lake are being written meanwhile (the
    # next window is prepared ahead), and a lake lost under a live run is the next tests'.
    backup = tmp_path / "table-backup"
    shutil.copytree(lake / "payments", backup)
    data.land(4)
    engine = Engine(job, settings, spark, pg_dsn)
    restored = []

    def restore_after_first(result) -> None:
        if not restored:
            # Swapped in by two renames: the window being prepared meanwhile sees the old table
            # or the restored one, not a table half copied (a lost table is another test's).
            staged = tmp_path / "table-restored"
            shutil.copytree(backup, staged)
            os.rename(lake / "payments", tmp_path / "table-replaced")
            os.rename(staged, lake / "payments")
            restored.append(result.window_id)

    with pytest.raises(SinkStateError, match="holds windows through 2"):
        engine.run(max_units_per_window=1, on_window=restore_after_first)
    assert restored == [3]
    assert_postgres_consistent(actual_outputs(pg_dsn, lake))
    with pytest.raises(SinkStateError, match="lake_payments lacks windows 3"):
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    reconcile(Engine(job, settings, spark, pg_dsn))
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert_exact(data.expected_for(4), actual_outputs(pg_dsn, lake))


def test_a_window_reconcile_cannot_put_back_leaves_the_later_ones_lacking(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """Windows 1–3 committed, the lake deleted, window 2's input gone: reconcile puts window 1
    back and stops there; window 3 is not replayed over the gap (which would make a table that
    looks as if it held window 2)."""
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(3)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    shutil.rmtree(lake)
    lake.mkdir()
    (landing / "payments" / data.files[1].name).unlink()

    engine = Engine(job, settings, spark, pg_dsn)
    replayed = engine.replay_lacking(engine.start("replay"), "replay")  # as reconcile does
    assert replayed.restored == {"lake_payments": [1]}, replayed
    assert replayed.left == {"lake_payments": [2, 3]}, replayed
    engine = Engine(job, settings, spark, pg_dsn)
    assert engine.lacking_windows() == {"lake_payments": [2, 3]}
    with pytest.raises(LedgerError, match="lake_payments lacks windows 2-3"):
        engine.run(max_units_per_window=1)


def test_a_postgres_sink_table_dropped_and_made_again_holds_none_of_its_markers(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """A PostgreSQL sink's table dropped between runs is created again, empty, by the next
    run's set-up; its commit markers describe the old table, so the run refuses (naming
    reconcile) instead of going on as if the new table held every window; reconcile puts
    them back, and the next run is exact."""
    settings = _settings(tmp_path, pg_dsn, lake, landing)
    job = get_job("payments")
    data = Landing(tmp_path, landing)
    data.land(4)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP TABLE public.payments")
    data.land(6)
    with pytest.raises(SinkStateError) as refused:
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert "pg_payments lacks windows 1-2" in refused.value.message
    assert "onceflow reconcile payments" in refused.value.message

    report = reconcile(Engine(job, settings, spark, pg_dsn))
    assert report.replayed == {"pg_payments": [1, 2]}, report
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=2)
    assert_exact(data.expected_for(6), actual_outputs(pg_dsn, lake))
