"""The ledger's per-window detail past the detail horizon: dropped by `onceflow maintain` with
its sums kept, the windows it served refused for restatement, every other path exact; and a
restatement racing the drop is either applied whole first or refused after (real processes,
real signals).

The payments job: the `payments` Delta and PostgreSQL sinks, the accumulating `balances`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from onceflow import _plans_folded as plans_folded
from onceflow import ops
from onceflow.engine import Engine
from onceflow.errors import LedgerError, SinkError, SinkStateError
from onceflow.generate import generate_payments
from onceflow.maintain import _detail
from onceflow.reconcile import reconcile
from onceflow.registry import get_job
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from onceflow.sinks.postgres import PostgresSink
from onceflow.sinks.postgres._markers import Marker
from tests.core.test_restate import _cli_env, _flat_fee_expected
from tests.support.cli import CliRun
from tests.support.flat_fee_payments import FLAT_FEE
from tests.support.oracle import expected_outputs, visible_files
from tests.support.outputs import actual_outputs, assert_exact, diff_outputs
from tests.support.pgproxy import PgProxy

JOB = "payments"


def _counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return {
            table: int(
                conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE job = %s").format(
                        sql.Identifier("onceflow", table)
                    ),
                    (JOB,),
                ).fetchone()[0]  # type: ignore[index]
            )
            for table in (
                "sink_versions",
                "window_contributions",
                "windows",
                "sink_commits",
                "sink_commits_folded",
            )
        }


def _marker_answers(settings: Settings, pg_dsn: str, spark: Any) -> dict[str, Any]:
    """Everything the PostgreSQL sinks' markers answer: which windows each sink holds, its last
    window and highest epoch, the windows a rebuild would put back (with their offsets and
    epochs), the status counts, the reconcile baseline's count and id sum at every point."""
    from onceflow.sinks.postgres._baseline import _facts
    from onceflow.sinks.postgres.group import PostgresGroup

    engine = Engine(get_job(JOB), settings, spark, pg_dsn)
    (group,) = [g for g in engine.groups if isinstance(g, PostgresGroup)]
    with psycopg.connect(pg_dsn) as conn:
        facts = {
            (spec.name, through): conn.execute(
                sql.SQL("SELECT {}").format(_facts(spec, JOB, sql.Literal(through)))
            ).fetchone()[:2]  # type: ignore[index]
            for spec in group.specs
            for through in range(0, 8)
        }
        sink = group.specs[0].name
        exists = [Marker(JOB, sink, w).exists(conn) for w in range(0, 8)]
    return {
        "held": group.held(range(0, 8)),
        "through": group.committed_through(),
        "epoch": group.epoch_floor(),
        "recorded": sorted(
            (r.window_id, r.epoch, str(r.offsets)) for r in group.recorded_windows()
        ),
        "recorded_after_2": sorted(r.window_id for r in group.recorded_windows(after=2)),
        "status": group.status(),
        "facts": facts,
        "exists": exists,
    }


def _plan_answers(settings: Settings, pg_dsn: str, spark: Any) -> dict[str, Any]:
    """Everything the windows' plans and stats answer: every window as the ledger reads it
    (whole, one by one, the newest offsets, the scans of a start-up), the lineage view's plan
    and counts, and the Delta quality suite's row count against the ledger."""
    from onceflow import _ledger_scan
    from onceflow.lineage import lineage

    ledger = Engine(get_job(JOB), settings, spark, pg_dsn).ledger
    every = ledger.windows()
    validation = ops.validate(get_job(JOB), settings, spark=spark, dsn=pg_dsn)
    return {
        "windows": [dataclasses.astuple(w) for w in every],
        "one_by_one": [dataclasses.astuple(ledger.window(w.window_id)) for w in every],
        "last_offsets": ledger.last_offsets(),
        "scan": [
            dataclasses.astuple(w)
            for w in _ledger_scan._windows(ledger, "window_id > %s", (1,), "scan")
        ],
        "lineage": [
            (
                r.window_id,
                r.offsets,
                r.rows_in,
                r.rows_out,
                r.duplicates,
                r.quarantined,
                r.rows_by_output,
            )
            for r in lineage(pg_dsn, JOB, limit=10)
        ],
        "row_counts": sorted(
            (r.sink, r.passed, {k: v for k, v in r.observed.items() if k != "delta_version"})
            for r in validation.report.results
            if r.check == "row_count"
        ),
    }


def _folded_rows(dsn: str) -> tuple[int, int]:
    """(windows rows whose plan is folded, folded plan rows) of the job."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM onceflow.windows WHERE job = %(job)s"
            "        AND offsets IS NULL AND stats IS NULL),"
            " (SELECT count(*) FROM onceflow.window_plans_folded WHERE job = %(job)s)",
            {"job": JOB},
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _pruned(dsn: str) -> dict[str, tuple[int, int, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT sink, through, windows, rows_written FROM onceflow.detail_pruned"
            " WHERE job = %s",
            (JOB,),
        ).fetchall()
    return {str(s): (int(t), int(w), int(r)) for s, t, w, r in rows}


def _lineage_sums(dsn: str) -> dict[str, tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT sink, count(*), coalesce(sum(rows_written), 0) FROM onceflow.sink_versions"
            " WHERE job = %s GROUP BY sink",
            (JOB,),
        ).fetchall()
    return {str(s): (int(n), int(r)) for s, n, r in rows}


@contextmanager
def _maintained(job: Any, settings: Settings, dsn: str) -> Iterator[list[Any]]:
    """Maintenance (every window past the detail horizon) over and over in a thread while
    the body runs; yields its results as they come, and fails if one raised."""
    stop = threading.Event()
    results: list[Any] = []
    errors: list[BaseException] = []

    def keep_maintaining() -> None:
        while not stop.is_set():
            try:
                results.append(ops.maintain(job, settings, dsn=dsn, jobs=[job], keep_detail_days=0))
            except Exception as exc:
                errors.append(exc)
            time.sleep(0.1)

    thread = threading.Thread(target=keep_maintaining)
    thread.start()
    try:
        yield results
    finally:
        stop.set()
        thread.join()
    assert not errors, errors


@pytest.fixture()
def settings(tmp_path: Path, pg_dsn: str, lake: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)


def test_detail_past_the_horizon_goes_its_sums_stay_and_restating_it_is_refused(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path, monkeypatch: Any
) -> None:
    generate_payments(landing, records=900, files=4, duplicate_rate=0.2, invalid_rate=0.1, seed=11)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    before = _counts(pg_dsn)
    lineage = _lineage_sums(pg_dsn)
    answers = _marker_answers(settings, pg_dsn, spark)
    plans = _plan_answers(settings, pg_dsn, spark)
    assert answers["exists"] == [False, True, True, True, True, False, False, False]
    assert len(plans["windows"]) == 4 and all(p[2] for p in plans["windows"])  # offsets
    assert all(passed for _, passed, _ in plans["row_counts"]), plans["row_counts"]
    assert len(answers["recorded"]) == 4 * len(answers["status"])
    assert before["window_contributions"] == 4 and before["sink_versions"] > 0

    # Windows planned within the default month keep everything.
    kept = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job])
    assert kept.detail.through == 0 and _counts(pg_dsn) == before

    # A dry run says what would go, and changes nothing.
    dry = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], dry_run=True, keep_detail_days=0)
    assert (dry.detail.through, dry.detail.lineage_rows) == (4, before["sink_versions"])
    assert dry.detail.contribution_rows == 4
    assert dry.detail.folded_records == before["sink_commits"]
    assert _counts(pg_dsn) == before and _pruned(pg_dsn) == {}

    monkeypatch.setattr(_detail, "CHUNK", 3)  # windows 1-3, then 4: two transactions
    done = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert done.detail.as_json() == {
        "through": 4,
        "before": 0,
        "lineage_rows": before["sink_versions"],
        "contribution_rows": 4,
        "folded_records": before["sink_commits"],
        "folded_plans": 4,
    }
    after = _counts(pg_dsn)
    assert after["sink_versions"] == 0 and after["window_contributions"] == 0
    # The plan stays whole; the markers are folded (a row per sink and transaction), and
    # answer every reader as they did.
    assert after["windows"] == before["windows"] and after["sink_commits"] == 0
    assert after["sink_commits_folded"] == 2 * len(answers["status"])
    assert _marker_answers(settings, pg_dsn, spark) == answers
    # The plans and stats are folded (a row per transaction), and answer every reader as
    # they did.
    assert _folded_rows(pg_dsn) == (4, 2)
    assert _plan_answers(settings, pg_dsn, spark) == plans
    pruned = _pruned(pg_dsn)
    assert {s: (w, r) for s, (_, w, r) in pruned.items() if w} == lineage
    assert {t for t, _, _ in pruned.values()} == {4}
    assert "dropped windows 1..4's" in "\n".join(done.lines())
    again = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert (again.detail.through, again.detail.lineage_rows) == (4, 0)

    # A window past the horizon cannot be restated where its contribution was needed.
    flat = Engine(FLAT_FEE, settings, spark, pg_dsn)
    with pytest.raises(SinkError, match="detail horizon"):
        restate_windows(flat, [2], request_id="too-old")

    # Everything else goes on: a new window, its restatement, a full reconcile, quality.
    generate_payments(landing, records=200, files=1, seed=12)
    files = visible_files(landing)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # window 5
    assert _counts(pg_dsn)["window_contributions"] == 1
    expected = expected_outputs(landing, windows=[[f] for f in files])
    assert_exact(expected, actual_outputs(pg_dsn, lake))
    report = ops.reconcile(job, settings, spark=spark, dsn=pg_dsn, dry_run=True)
    assert report.clean and report.windows_recomputed == 5, report
    restate_windows(flat, [5], request_id="recent")
    assert_exact(_flat_fee_expected(expected, {files[4]}), actual_outputs(pg_dsn, lake))
    assert ops.validate(job, settings, spark=spark, dsn=pg_dsn).passed


def test_the_horizon_stops_below_open_windows_and_restatements(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path
) -> None:
    generate_payments(landing, records=600, files=4, duplicate_rate=0.1, invalid_rate=0.1, seed=13)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    with psycopg.connect(pg_dsn) as conn:  # as an unfinished restatement of window 3 leaves it
        conn.execute(
            "INSERT INTO onceflow.restatements (job, seq, window_id, request_id, epoch)"
            " VALUES (%s, 1, 3, 'open', 1)",
            (JOB,),
        )
    first = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert first.detail.through == 2 and first.detail.contribution_rows == 2
    with psycopg.connect(pg_dsn) as conn:
        kept = conn.execute(
            "SELECT array_agg(window_id ORDER BY window_id) FROM onceflow.window_contributions"
            " WHERE job = %s",
            (JOB,),
        ).fetchone()[0]  # type: ignore[index]
        assert kept == [3, 4]
        conn.execute("UPDATE onceflow.restatements SET cancelled_at = now() WHERE job = %s", (JOB,))
    # Nor past a window not yet completed, nor past one planned within the kept days.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE onceflow.windows SET completed_at = NULL WHERE job = %s AND window_id = 4",
            (JOB,),
        )
    assert (
        ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0).detail.through == 3
    )
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE onceflow.windows SET completed_at = now() WHERE job = %s AND window_id = 4",
            (JOB,),
        )
    assert (
        ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=1).detail.through == 3
    )
    with pytest.raises(Exception, match="keep_detail_days must not be negative"):
        ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=-1)


def test_detail_dropped_again_and_again_while_a_run_commits_its_windows(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    """Maintenance in a thread, dropping everything past the horizon over and over, while a
    run plans and commits six windows: every window exact, no maintenance failed, and each
    drop stopped below the windows the run was working on."""
    generate_payments(landing, records=900, files=6, duplicate_rate=0.2, invalid_rate=0.1, seed=15)
    files = visible_files(landing)
    job = get_job(JOB)
    with _maintained(job, settings, pg_dsn) as results:
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert any(r.detail.contribution_rows for r in results), [r.detail for r in results]
    assert_exact(
        expected_outputs(landing, windows=[[f] for f in files]), actual_outputs(pg_dsn, lake)
    )
    last = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert last.detail.through == 6 and _counts(pg_dsn)["window_contributions"] == 0
    assert ops.validate(job, settings, spark=spark, dsn=pg_dsn).passed


def test_a_lost_ledger_is_rebuilt_from_folded_markers_and_no_input_is_taken_twice(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    """The payments job without its Delta sink (the markers are the only record of its
    windows): windows folded by maintenance, then the ledger's plan and unit index lost. The
    next run puts the folded windows back as they were and plans only the new file."""
    pg_only = dataclasses.replace(
        get_job(JOB),
        dedupe=None,  # the key index keeps its state in a Delta sink: no duplicates here
        sinks=tuple(s for s in get_job(JOB).sinks if isinstance(s, PostgresSink)),
    )
    generate_payments(landing, records=800, files=4, duplicate_rate=0, invalid_rate=0.1, seed=17)
    Engine(pg_only, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    plan = {
        w.window_id: (w.offsets, w.epoch)
        for w in Engine(pg_only, settings, spark, pg_dsn).ledger.windows()
    }
    markers = _counts(pg_dsn)["sink_commits"]
    assert markers == 4 * 3  # pg_payments, pg_merchant_balances, the quarantine
    done = ops.maintain(pg_only, settings, dsn=pg_dsn, jobs=[pg_only], keep_detail_days=0)
    assert done.detail.folded_records == markers and _counts(pg_dsn)["sink_commits"] == 0

    with psycopg.connect(pg_dsn) as conn:
        for table in ("windows", "source_units"):
            conn.execute(sql.SQL("DROP TABLE {} CASCADE").format(sql.Identifier("onceflow", table)))
    generate_payments(landing, records=200, files=1, duplicate_rate=0, seed=18)
    files = visible_files(landing)
    result = Engine(pg_only, settings, spark, pg_dsn).run(max_units_per_window=1)
    assert [w.window_id for w in result.windows if not w.noop] == [5], result

    rebuilt = Engine(pg_only, settings, spark, pg_dsn).ledger.windows()
    assert {w.window_id: (w.offsets, w.epoch) for w in rebuilt if w.window_id <= 4} == plan
    diffs = diff_outputs(
        expected_outputs(landing, windows=[[f] for f in files]), actual_outputs(pg_dsn, lake)
    )
    assert {name: (d.lost, d.doubled, d.extra, d.changed) for name, d in diffs.items()} == {
        "delta payments": (diffs["delta payments"].lost, 0, 0, 0),  # no Delta sink here
        "pg payments": (0, 0, 0, 0),
        "merchant_balances": (0, 0, 0, 0),
        "quarantine": (0, 0, 0, 0),
    }


def _waiting_for_a_lock(dsn: str) -> bool:
    """Whether a session of this database waits for a lock (the second process, on the job's
    row)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
    return bool(row and row[0])


def _wait_until(what: str, done: Any, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("first", ["restatement", "maintenance"])
def test_a_restatement_racing_the_drop_is_applied_whole_or_refused(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path, tmp_path: Path,
    first: str,
) -> None:  # fmt: skip
    """The two real processes meet at the job's row: the first stopped by SIGSTOP while it
    holds it (the restatement just before its COMMIT; maintenance after reading its horizon),
    the other started and waiting for the row, then the first let go (SIGCONT). Either the
    restatement is applied whole and its window's detail kept until it is done, or it is
    refused and changes nothing; a frozen maintenance never stalls the run that needs the row
    (it ends the frozen session, and the drop is done by the next maintenance)."""
    generate_payments(landing, records=900, files=4, duplicate_rate=0.2, invalid_rate=0.1, seed=14)
    files = visible_files(landing)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    expected = expected_outputs(landing, windows=[[f] for f in files])
    logs = tmp_path / "logs"
    flat = {"ONCEFLOW_JOBS": "tests.support.flat_fee_payments:FLAT_FEE"}
    restate = ["restate", JOB, "--windows", "2", "--request-id", "race"]
    maintain = ["maintain", JOB, "--keep-detail-days", "0", "--json"]
    fault = "before_pg_commit@2:stop" if first == "restatement" else "prune_locked:stop"
    held = CliRun(
        restate if first == "restatement" else maintain,
        _cli_env(settings, ONCEFLOW_FAULT=fault, **flat),
        logs,
    )
    try:
        frozen = psutil.Process(held.pid)
        _wait_until(
            "froze at its fault point",
            lambda: held.proc.poll() is not None or frozen.status() == psutil.STATUS_STOPPED,
        )
        assert held.proc.poll() is None, held.finish().stderr[-2000:]
        other = CliRun(
            maintain if first == "restatement" else restate, _cli_env(settings, **flat), logs
        )
        try:
            _wait_until(
                "waited for the job's row",
                lambda: other.proc.poll() is not None or _waiting_for_a_lock(pg_dsn),
            )
            os.kill(held.pid, signal.SIGCONT)
            one, two = held.finish(), other.finish()
        finally:
            other.kill_group()
    finally:
        held.kill_group()
    restated, maintained = (one, two) if first == "restatement" else (two, one)
    if restated.returncode == 0:  # applied whole
        assert_exact(_flat_fee_expected(expected, {files[1]}), actual_outputs(pg_dsn, lake))
    else:  # refused: the drop came first
        assert "detail horizon" in restated.stderr, restated.stderr[-2000:]
        assert_exact(expected, actual_outputs(pg_dsn, lake))
    if first == "restatement":
        assert restated.returncode == 0, restated.stderr[-2000:]
        assert maintained.returncode == 0, maintained.stderr[-2000:]
    # The next maintenance drops what is past the horizon now; nothing is left pending.
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert _counts(pg_dsn)["window_contributions"] == 0
    assert ops.validate(job, settings, spark=spark, dsn=pg_dsn).passed


def test_folded_plans_answer_the_quality_sums_by_their_totals_or_window_by_window(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, monkeypatch: Any
) -> None:
    """The folded rows' sums where they hold every window asked about; their plans one by
    one where a window is abandoned for the sink or the point cuts through a row: the same
    counts. Two windows a folded row: rows [1, 2], [3, 4], [5]."""
    monkeypatch.setattr(plans_folded, "ROW_WINDOWS", 2)
    generate_payments(landing, records=900, files=5, duplicate_rate=0.2, invalid_rate=0.1, seed=21)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-5
    planned = Engine(job, settings, spark, pg_dsn).ledger.windows()
    stats = {w.window_id: w.stats for w in planned}
    offsets = {w.window_id: w.offsets for w in planned}
    counts = {w: int(s["outputs"]["payments"]) for w, s in stats.items()}
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert _folded_rows(pg_dsn) == (5, 3)
    with psycopg.connect(pg_dsn) as conn:
        whole = plans_folded.output_sums(conn, JOB, "payments", set())
        assert whole == plans_folded.OutputSums(0, sum(counts.values()), 0)
        assert plans_folded.output_sums(conn, JOB, "no_such_output", set()) == (
            plans_folded.OutputSums(5, 0, 0)
        )
        gap = plans_folded.output_sums(conn, JOB, "payments", {2})
        assert gap == plans_folded.OutputSums(0, sum(counts.values()) - counts[2], counts[2])
        cut = plans_folded.output_sums(conn, JOB, "payments", set(), through=3)
        assert cut == plans_folded.OutputSums(0, counts[1] + counts[2] + counts[3], 0)
    # A folded window counted again (a restatement whose transform keeps other rows) has its
    # new stats where its plan is: read back, and in the sums.
    ledger = Engine(job, settings, spark, pg_dsn).ledger
    again = {**stats[3], "outputs": {**stats[3]["outputs"], "payments": counts[3] + 7}}
    ledger.record_stats(3, again)
    assert ledger.window(3).stats == again  # type: ignore[union-attr]
    assert ledger.window(3).offsets == offsets[3]  # type: ignore[union-attr]
    assert _folded_rows(pg_dsn) == (5, 3)
    with psycopg.connect(pg_dsn) as conn:
        assert (
            plans_folded.output_sums(conn, JOB, "payments", set()).rows == sum(counts.values()) + 7
        )
        assert plans_folded.output_sums(conn, JOB, "payments", {1}).rows == (
            sum(counts.values()) + 7 - counts[1]
        )


def test_a_lost_delta_table_is_replayed_from_folded_plans_while_maintenance_folds(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    """Windows folded, then the Delta table deleted: the run refuses, the reconcile replays
    the windows from their folded plans and the next run goes on, while maintenance folds
    over and over (each new window as soon as it completes). Exact, and still folded."""
    generate_payments(landing, records=900, files=4, duplicate_rate=0.2, invalid_rate=0.1, seed=19)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    assert (
        ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0).detail.folded_plans
        == 4
    )
    shutil.rmtree(lake / "payments")  # the lake_payments table, from outside
    generate_payments(landing, records=300, files=2, seed=20)
    files = visible_files(landing)
    with pytest.raises(SinkStateError, match="lacks windows 1-4"):
        Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)

    with _maintained(job, settings, pg_dsn):
        report = reconcile(Engine(job, settings, spark, pg_dsn))
        assert report.replayed == {"lake_payments": [1, 2, 3, 4]} and report.clean, report
        result = Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)
        assert [w.window_id for w in result.windows] == [5, 6]
    assert_exact(
        expected_outputs(landing, windows=[[f] for f in files]), actual_outputs(pg_dsn, lake)
    )
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert _folded_rows(pg_dsn)[0] == 6
    assert ops.validate(job, settings, spark=spark, dsn=pg_dsn).passed


def test_folded_plans_lost_are_named_and_nothing_is_computed(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    generate_payments(landing, records=400, files=2, duplicate_rate=0.1, seed=22)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-2
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM onceflow.window_plans_folded WHERE job = %s", (JOB,))
    shutil.rmtree(lake / "payments")
    with pytest.raises(LedgerError, match=r"onceflow\.window_plans_folded no longer holds them"):
        reconcile(Engine(job, settings, spark, pg_dsn))
    assert not (lake / "payments").exists()


def test_a_folded_window_is_restated_from_its_folded_plan(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, lake: Path
) -> None:
    """The payments job without its accumulating sink (no contribution to lose at the
    horizon): a reconcile recomputes every window from the folded plans, and a window whose
    plan is folded is restated from it; exact."""

    def no_balances(job: Any) -> Any:
        return dataclasses.replace(
            job, sinks=tuple(s for s in job.sinks if s.name != "pg_merchant_balances")
        )

    generate_payments(landing, records=900, files=4, duplicate_rate=0.2, invalid_rate=0.1, seed=23)
    files = visible_files(landing)
    job, flat = no_balances(get_job(JOB)), no_balances(FLAT_FEE)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-4
    assert (
        ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0).detail.folded_plans
        == 4
    )
    report = ops.reconcile(job, settings, spark=spark, dsn=pg_dsn, dry_run=True)
    assert report.clean and report.windows_recomputed == 4, report
    restate_windows(Engine(flat, settings, spark, pg_dsn), [2], request_id="folded")
    expected = _flat_fee_expected(
        expected_outputs(landing, windows=[[f] for f in files]), {files[1]}
    )
    diffs = diff_outputs(expected, actual_outputs(pg_dsn, lake))
    assert {name: d.exact for name, d in diffs.items()} == {
        "delta payments": True,
        "pg payments": True,
        "merchant_balances": False,  # not a sink of this job
        "quarantine": True,
    }, diffs
    assert _folded_rows(pg_dsn) == (4, 1)


def test_a_plan_put_back_in_a_folded_range_is_folded_again_with_the_rest_kept(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path, monkeypatch: Any
) -> None:
    """Windows 2 and 4 put back with their plans (as a rebuild after a lost `windows` table
    does) and the detail horizon forgotten: the next fold takes them again and keeps every
    other window of the old folded rows, window 3 between them too; every plan reads as it
    did. Two windows a folded row: [1, 2], [3, 4], [5], then [1, 2] and [3, 4] made again."""
    monkeypatch.setattr(plans_folded, "ROW_WINDOWS", 2)
    generate_payments(landing, records=600, files=5, duplicate_rate=0.1, seed=24)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-5
    planned = [
        dataclasses.astuple(w) for w in Engine(job, settings, spark, pg_dsn).ledger.windows()
    ]
    ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert _folded_rows(pg_dsn) == (5, 3)
    with psycopg.connect(pg_dsn) as conn:
        for window in (planned[1], planned[3]):
            conn.execute(
                "UPDATE onceflow.windows SET offsets = %s, stats = %s WHERE job = %s"
                " AND window_id = %s",
                (Jsonb(window[2]), Jsonb(window[4]), JOB, window[1]),
            )
        conn.execute("DELETE FROM onceflow.detail_pruned WHERE job = %s", (JOB,))
    assert _folded_rows(pg_dsn) == (3, 3)
    again = ops.maintain(job, settings, dsn=pg_dsn, jobs=[job], keep_detail_days=0)
    assert again.detail.folded_plans == 2
    assert _folded_rows(pg_dsn) == (5, 3)
    assert [
        dataclasses.astuple(w) for w in Engine(job, settings, spark, pg_dsn).ledger.windows()
    ] == planned
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT first_window, last_window, windows FROM onceflow.window_plans_folded"
            " WHERE job = %s ORDER BY first_window",
            (JOB,),
        ).fetchall()
    assert rows == [(1, 2, 2), (3, 4, 2), (5, 5, 1)]


def test_folds_whose_answers_are_lost_are_decided_by_what_they_folded(
    spark: Any, settings: Settings, pg_dsn: str, landing: Path
) -> None:
    """Maintenance through a network that loses answers (a proxy): first the answer to the
    COMMIT of the transaction that drops the detail and folds the plans (it applied), then a
    share of every answer, COMMITs included. Every window folded once, none lost, every plan
    reads as it did."""
    generate_payments(landing, records=800, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=25)
    job = get_job(JOB)
    Engine(job, settings, spark, pg_dsn).run(max_units_per_window=1)  # windows 1-6
    planned = [
        dataclasses.astuple(w) for w in Engine(job, settings, spark, pg_dsn).ledger.windows()
    ]
    with PgProxy(pg_dsn) as proxy:
        through = proxy.dsn(str(psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]))
        via = dataclasses.replace(settings, postgres_dsn=through)
        with psycopg.connect(pg_dsn) as conn:  # windows 1-3 past the horizon, 4-6 within it
            conn.execute(
                "UPDATE onceflow.windows SET planned_at = now() - interval '2 days'"
                " WHERE job = %s AND window_id <= 3",
                (JOB,),
            )
        proxy.lose_commit_of("SELECT 1 FROM onceflow.jobs WHERE job")
        first = ops.maintain(job, via, dsn=through, jobs=[job], keep_detail_days=1)
        assert proxy.lost("commit") == 1
        assert (first.detail.through, _folded_rows(pg_dsn)) == (3, (3, 1))
        proxy.flaky(commits=0.2, replies=0.05, seed=26)
        second = ops.maintain(job, via, dsn=through, jobs=[job], keep_detail_days=0)
        proxy.flaky()
        print(f"\nanswers lost: {proxy.lost('commit')} COMMITs, {proxy.lost('reply')} others")
        assert proxy.lost() > 2
    assert second.detail.through == 6 and _folded_rows(pg_dsn) == (6, 2)
    assert [
        dataclasses.astuple(w) for w in Engine(job, settings, spark, pg_dsn).ledger.windows()
    ] == planned
    assert ops.validate(job, settings, spark=spark, dsn=pg_dsn).passed
