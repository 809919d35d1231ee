"""The lineage view holds, per window, exactly what the ledger, the Delta log and the PostgreSQL
commit transactions say: offsets, counts, Delta versions, transaction ids, latest checks."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable

from onceflow.generate import generate_payments
from onceflow.lineage import lineage
from onceflow.validation import validate_job
from tests.core.test_exactly_once import JOB, PG_SINKS, make_engine
from tests.support.cli import ONCEFLOW, CliRun, cli_env


def _delta_versions(lake: Path) -> dict[int, int]:
    """Window id → the Delta version whose commit metadata names it (the Delta log's word)."""
    return {
        int(entry["onceflow.window_id"]): int(entry["version"])
        for entry in DeltaTable(str(lake / "payments")).history()
        if "onceflow.window_id" in entry
    }


def test_lineage_rows_match_the_ledger_the_delta_log_and_the_transactions(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    assert lineage(pg_dsn, JOB) == []  # no ledger yet: nothing, and no error
    generate_payments(landing, records=600, files=3, duplicate_rate=0.1, invalid_rate=0.05, seed=3)
    engine.run(max_units_per_window=1)

    rows = lineage(pg_dsn, JOB)
    assert [r.window_id for r in rows] == [3, 2, 1]  # newest first
    assert all(r.checks == 0 and r.checks_passed is None for r in rows)  # no check ran yet
    delta = _delta_versions(lake)
    with psycopg.connect(pg_dsn) as conn:
        ledger = {
            int(w): (o, s, int(e))
            for w, o, s, e in conn.execute(
                "SELECT window_id, offsets, stats, epoch FROM onceflow.windows WHERE job = %s",
                (JOB,),
            )
        }
        for row in rows:
            offsets, stats, epoch = ledger[row.window_id]
            assert row.offsets == offsets and row.epoch == epoch
            assert row.completed_at is not None and row.skipped is None
            assert (row.rows_in, row.rows_out, row.duplicates, row.quarantined) == (
                stats["rows_in"],
                stats["kept"],
                stats["duplicates"],
                stats["quarantined"],
            )
            assert row.rows_by_output == stats["outputs"]
            assert row.data_versions == {"lake_payments": delta[row.window_id]}
            # One transaction commits a window to every PostgreSQL sink, and it is the one that
            # wrote the window's rows (their xmin; a fresh database, so xid epoch 0).
            assert set(row.commit_refs) == set(PG_SINKS)
            (xid,) = set(row.commit_refs.values())
            writers = conn.execute(
                "SELECT DISTINCT xmin::text FROM onceflow.quarantine WHERE job = %s AND"
                " window_id = %s UNION SELECT DISTINCT xmin::text FROM payments"
                " WHERE _window_id = %s",
                (JOB, row.window_id, row.window_id),
            ).fetchall()
            assert writers == [(xid,)]
            assert row.rows_committed["pg_quarantine"] == row.quarantined

    report = validate_job(engine)
    assert report.passed
    checked = lineage(pg_dsn, JOB)
    assert all(r.checks == len(report.results) and r.checks_passed for r in checked)
    assert all(r.checks_failed == 0 and r.checked_at is not None for r in checked)

    # A window committed after the checks ran is not covered by them.
    generate_payments(landing, records=100, files=1, seed=4)
    engine.run()
    newest, *older = lineage(pg_dsn, JOB, limit=2)
    assert newest.window_id == 4 and newest.checks_passed is None
    assert older[0].checks_passed is True

    # Damage from outside onceflow: the next checks fail, and every covered window says so.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM payments WHERE payment_id = (SELECT min(payment_id) FROM payments)"
        )
    assert not validate_job(engine).passed
    damaged = lineage(pg_dsn, JOB)
    assert all(r.checks_passed is False and r.checks_failed >= 1 for r in damaged)


def test_status_json_holds_the_lineage_without_spark(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    import os
    import subprocess

    home = tmp_path / "home"
    engine = make_engine(spark, pg_dsn, lake, landing, home)
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=5)
    engine.run(max_units_per_window=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCEFLOW_", "XDG_RUNTIME"))}
    env.update(
        ONCEFLOW_POSTGRES_DSN=pg_dsn,
        ONCEFLOW_LAKE=str(lake),
        ONCEFLOW_LANDING=str(landing),
        ONCEFLOW_HOME=str(home),
        # A Spark start would fail here: status must not need one.
        JAVA_HOME="/nonexistent",
        PATH="/usr/bin:/bin",
    )
    done = subprocess.run(
        [ONCEFLOW, "status", JOB, "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr and "log4j" not in done.stderr, done.stderr
    status = json.loads(done.stdout)
    assert status["job"] == JOB and status["epoch"] == 1
    assert status["sinks"]["pg_payments"]["committed_through"] == 2
    assert status["sinks"]["lake_payments"]["committed_through"] == 2
    assert status["lag"]["unplanned_units"] == 0
    expected = [r.as_json() for r in lineage(pg_dsn, JOB)]
    assert status["lineage"] == json.loads(json.dumps(expected))
    assert [r["window_id"] for r in status["lineage"]] == [2, 1]
    assert status["lineage"][0]["data_versions"]["lake_payments"] >= 1
    assert set(status["lineage"][0]["commit_refs"]) == set(PG_SINKS)
    # The DSN's credentials never reach the output.
    password = psycopg.conninfo.conninfo_to_dict(pg_dsn).get("password")
    if password:
        assert password not in done.stdout + done.stderr


def test_a_window_a_killed_run_committed_keeps_its_commits_in_lineage(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    """A run killed after every sink committed window 2, before the ledger completed it: the
    run that completes it records each sink's own record of that commit."""
    home = tmp_path / "home"
    generate_payments(landing, records=600, files=3, duplicate_rate=0.1, invalid_rate=0.05, seed=6)
    env = cli_env(home=home, dsn=pg_dsn, lake=lake, landing=landing, fault="after_commits@2")
    crashed = CliRun(["run", JOB, "--max-files-per-window", "1"], env, home / "logs").finish()
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "fault injected at after_commits (window 2)" in crashed.stderr
    with psycopg.connect(pg_dsn) as conn:
        completed = conn.execute(
            "SELECT window_id FROM onceflow.windows WHERE job = %s AND completed_at IS NOT NULL",
            (JOB,),
        ).fetchall()
    assert completed == [(1,)]  # window 2 committed everywhere, not completed

    result = make_engine(spark, pg_dsn, lake, landing, home).run(max_units_per_window=1)
    held = next(w for w in result.windows if w.window_id == 2)
    assert all(o.already_committed for o in held.sinks.values())  # this run wrote nothing of it

    rows = {r.window_id: r for r in lineage(pg_dsn, JOB)}
    assert sorted(rows) == [1, 2, 3] and all(r.completed_at is not None for r in rows.values())
    delta = _delta_versions(lake)
    row = rows[2]
    assert row.data_versions == {"lake_payments": delta[2]}
    assert row.rows_committed["lake_payments"] == row.rows_out
    assert set(row.commit_refs) == set(PG_SINKS)
    (xid,) = set(row.commit_refs.values())
    with psycopg.connect(pg_dsn) as conn:
        writers = conn.execute(
            "SELECT DISTINCT xmin::text FROM onceflow.quarantine WHERE job = %s AND"
            " window_id = 2 UNION SELECT DISTINCT xmin::text FROM payments WHERE _window_id = 2",
            (JOB,),
        ).fetchall()
    assert writers == [(xid,)]
    # The windows before and after, committed and completed by one run each, as always.
    for other in (1, 3):
        assert rows[other].data_versions == {"lake_payments": delta[other]}
        assert set(rows[other].commit_refs) == set(PG_SINKS)
