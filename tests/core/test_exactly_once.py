"""Exactly-once, in process: oracle-exact outputs, no-op reruns, unanswered COMMIT, Delta races."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from onceflow.engine import Engine, build_engine
from onceflow.errors import FencedError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.settings import Settings
from onceflow.sinks.delta import DeltaTableSink
from onceflow.sinks.postgres.commit import Transaction
from onceflow.sinks.writers import spark_schema_to_arrow
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.pgproxy import PgProxy

JOB = "payments"
PG_SINKS = ("pg_payments", "pg_merchant_balances", "pg_quarantine")


def make_engine(
    spark: Any, dsn: str, lake: Path, landing: Path, home: Path, guarantee: str | None = None
) -> Engine:
    settings = Settings(home=home, postgres_dsn=dsn, lake=lake, landing=landing)
    return build_engine(PAYMENTS, settings, spark, dsn, guarantee=guarantee)


def markers(dsn: str) -> dict[str, dict[int, int]]:
    """rows_written of every sink commit marker, by sink and window."""
    out: dict[str, dict[int, int]] = {}
    with psycopg.connect(dsn) as conn:
        for sink, wid, rows in conn.execute(
            "SELECT sink, window_id, rows_written FROM onceflow.sink_commits WHERE job = %s",
            (JOB,),
        ):
            out.setdefault(sink, {})[int(wid)] = int(rows)
    return out


def window_stats(dsn: str) -> dict[int, dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT window_id, stats FROM onceflow.windows WHERE job = %s AND completed_at"
            " IS NOT NULL",
            (JOB,),
        ).fetchall()
    return {int(w): s for w, s in rows}


def snapshot(dsn: str, lake: Path) -> tuple[Any, ...]:
    actual = actual_outputs(dsn, lake)
    return (
        sorted(actual.delta_payments),
        sorted(actual.pg_payments),
        sorted(actual.balances),
        sorted(actual.quarantine, key=lambda q: (q.source_file, q.source_line)),
        sorted(DeltaTable(str(lake / "payments")).file_uris()),
    )


def test_end_to_end_equals_oracle_and_rerun_changes_nothing(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    # (seed, records, files, max files per window): the second batch repeats ids of the first
    # with other fields, far later; the third adds new ids. Only batch one has edge amounts
    # (records >= 80), so every balance fits 64 bits.
    batches = [(0, 1500, 4, 2), (0, 400, 3, 1), (11, 9, 3, 3)]
    window_ids: list[int] = []
    for seed, records, files, per_window in batches:
        generate_payments(
            landing,
            records=records,
            files=files,
            duplicate_rate=0.15,
            invalid_rate=0.08,
            seed=seed,
        )
        result = engine.run(max_units_per_window=per_window)
        window_ids += [w.window_id for w in result.windows]
        assert len(result.windows) == -(-files // per_window)
        # Staged, then visible in every sink, then completed: each after the one before.
        assert all(0 < w.compute_s < w.visible_s < w.latency_s for w in result.windows)
        expected = expected_outputs(landing)
        assert_exact(expected, actual_outputs(pg_dsn, lake))
    assert window_ids == list(range(1, len(window_ids) + 1))
    assert min(p[3] for p in expected.payments.values()) == -(2**63)
    assert max(p[3] for p in expected.payments.values()) == 2**63 - 1
    assert len(expected.quarantine) > 50 and expected.duplicates > 100
    stats = window_stats(pg_dsn)
    assert sum(s["duplicates"] for s in stats.values()) == expected.duplicates
    assert sum(s["quarantined"] for s in stats.values()) == len(expected.quarantine)
    assert {s: set(w) for s, w in markers(pg_dsn).items()} == {s: set(window_ids) for s in PG_SINKS}

    before = snapshot(pg_dsn, lake)
    again = engine.run(max_units_per_window=1)
    assert again.windows == []
    # Same rows and same data files; the Delta log only gains the new run's epoch claim.
    assert snapshot(pg_dsn, lake) == before
    assert max(window_stats(pg_dsn)) == window_ids[-1]


def test_proxy_swallows_the_answer_of_a_committed_transaction(pg_dsn: str) -> None:
    from onceflow.sinks.postgres._markers import create_protocol_tables

    with psycopg.connect(pg_dsn) as conn:
        create_protocol_tables(conn)
    dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    with PgProxy(pg_dsn) as proxy:
        proxy.arm(b"sink-x")
        conn = psycopg.connect(proxy.dsn(str(dbname)))
        conn.execute(
            "INSERT INTO onceflow.sink_commits (job, sink, window_id, epoch, xid, offsets,"
            " rows_written) VALUES (%s, %s, 1, 1, pg_current_xact_id(), '{}', 0)",
            (JOB, "sink-x"),
        )
        with pytest.raises(psycopg.OperationalError):
            conn.commit()
        conn.close()
        assert len(proxy.drops) == 1 and proxy.drops[0].reply_bytes > 0
    with psycopg.connect(pg_dsn) as direct:
        assert direct.execute("SELECT count(*) FROM onceflow.sink_commits").fetchone() == (1,)


def test_unanswered_commit_is_resolved_by_the_marker(
    spark: Any,
    pg_dsn: str,
    lake: Path,
    landing: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generate_payments(landing, records=600, files=2, duplicate_rate=0.1, invalid_rate=0.05)
    dbname = str(psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"])
    resolutions: list[tuple[int, bool, bool]] = []
    original = Transaction._resolve

    def spy(self: Transaction, marker: Any, xid: str, epoch: int) -> bool:
        with psycopg.connect(pg_dsn) as direct:  # not through the proxy
            row = direct.execute(
                "SELECT 1 FROM onceflow.sink_commits WHERE job = %s AND sink = %s"
                " AND window_id = %s",
                (JOB, marker.sink, marker.window_id),
            ).fetchone()
        decided = original(self, marker, xid, epoch)
        resolutions.append((marker.window_id, row is not None, decided))
        return decided

    monkeypatch.setattr(Transaction, "_resolve", spy)
    with PgProxy(pg_dsn) as proxy:
        engine = make_engine(spark, proxy.dsn(dbname), lake, landing, tmp_path / "home")
        engine.prepare()
        proxy.arm(b"pg_payments")
        result = engine.run(max_units_per_window=1)
        assert proxy.armed == 0 and len(proxy.drops) == 1
    assert resolutions == [(1, True, True)]
    assert [w.window_id for w in result.windows] == [1, 2]
    assert all(w.sinks["pg_payments"].committed for w in result.windows)

    got = markers(pg_dsn)
    assert {s: set(w) for s, w in got.items()} == {s: {1, 2} for s in PG_SINKS}
    actual = actual_outputs(pg_dsn, lake)
    per_window = {w: sum(1 for p in actual.pg_payments if p[6] == w) for w in (1, 2)}
    assert got["pg_payments"] == per_window  # written once, not redone
    assert_exact(expected_outputs(landing), actual)
    with psycopg.connect(pg_dsn) as direct:
        litter = direct.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'onceflow'"
            " AND tablename LIKE 'stage\\_%'"
        ).fetchone()
    assert litter == (0,)


def _commit(sink: DeltaTableSink, df: Any, window_id: int, *, epoch: int, run_id: str) -> Any:
    """A window's commit as the Delta group makes it: the table, the executors' files, the
    commit that decides (held already, fenced, or committed)."""
    sink.ensure_table(spark_schema_to_arrow(df))
    adds = sink.write_files(df, window_id, epoch)
    return sink.commit_files(
        adds, window_id=window_id, epoch=epoch, run_id=run_id, offsets={"w": window_id}
    )


def _race(sink: DeltaTableSink, df: Any, window_id: int) -> list[Any]:
    barrier = threading.Barrier(2)
    outcomes: list[Any] = [None, None]

    def writer(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = _commit(sink, df, window_id, epoch=1, run_id=f"writer-{i}")
        except Exception as exc:  # reported below, not swallowed
            outcomes[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return outcomes


def test_two_writers_racing_for_a_delta_window_commit_once(spark: Any, lake: Path) -> None:
    sink = DeltaTableSink(JOB, "race", lake / "race")
    df = spark.range(0, 250, numPartitions=2).selectExpr("id", "cast(id as string) AS label")
    rounds = 4
    for window_id in range(1, rounds + 1):
        outcomes = _race(sink, df, window_id)
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        winners = [o for o in outcomes if not o.already_committed]
        assert len(winners) == 1, outcomes
        assert winners[0].rows == 250
        table = DeltaTable(str(sink.path))
        assert table.transaction_version(sink.app_id) == window_id
        assert table.to_pyarrow_table().num_rows == 250 * window_id
        folders = sink.path.children(f"w{window_id:010d}-")
        assert len(folders) == 1  # the loser's files are gone
    commits = [
        int(e["onceflow.window_id"])
        for e in DeltaTable(str(sink.path)).history()
        if "onceflow.window_id" in e
    ]
    assert sorted(commits) == list(range(1, rounds + 1))


def test_zombie_delta_commit_is_fenced_and_writes_nothing(spark: Any, lake: Path) -> None:
    sink = DeltaTableSink(JOB, "fence", lake / "fence")
    df = spark.range(0, 50).selectExpr("id")
    first = _commit(sink, df, 1, epoch=1, run_id="old")
    assert not first.already_committed and first.rows == 50
    sink.claim_epoch(2)
    version = DeltaTable(str(sink.path)).version()
    with pytest.raises(FencedError, match="fenced"):
        _commit(sink, df, 2, epoch=1, run_id="old")
    table = DeltaTable(str(sink.path))
    assert table.version() == version
    assert table.transaction_version(sink.app_id) == 1
    assert table.to_pyarrow_table().num_rows == 50
    assert not [f for f in table.file_uris() if "/w0000000002-" in f]  # none of its files
    with pytest.raises(FencedError):
        sink.claim_epoch(1)
    newer = _commit(sink, df, 2, epoch=2, run_id="new")
    assert not newer.already_committed and DeltaTable(str(sink.path)).version() == version + 1


def test_at_least_once_gives_exact_results_without_crashes(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=800, files=3, duplicate_rate=0.1, invalid_rate=0.05)
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home", guarantee="at_least_once")
    assert not engine.exactly_once
    result = engine.run(max_units_per_window=1)
    assert len(result.windows) == 3
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_windows_after_the_first_compile_no_new_code_and_stay_exact(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    # A window's plan must not embed its id as a literal (in the platform or the reference
    # transform): Spark would generate, compile and JIT-compile its code again for every window.
    generate_payments(landing, records=2_000, files=5, duplicate_rate=0.1, invalid_rate=0.05)
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    counts: dict[int, int] = {}

    def after(window: Any) -> None:
        counts[window.window_id] = int(compiled.getCount())

    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    result = engine.run(max_units_per_window=1, on_window=after)
    assert [w.window_id for w in result.windows] == [1, 2, 3, 4, 5]
    # Windows 4 and 5 are prepared after window 2 is done: the code of window 1 serves them.
    assert counts[5] == counts[2], counts
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_each_window_is_read_counted_and_written_by_one_spark_job(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    # Scheduling a Spark job (and a broadcast, for a join) is a fixed cost of every window: its
    # read, parse, key lookup, counts and every sink's writes share one job.
    generate_payments(landing, records=2_000, files=4, duplicate_rate=0.1, invalid_rate=0.05)
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup())
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    result = engine.run(max_units_per_window=1)
    jobs = set(tracker.getJobIdsForGroup()) - before
    assert [w.window_id for w in result.windows] == [1, 2, 3, 4]
    assert len(jobs) == 4, sorted(jobs)
    assert all(w.stats["rows_in"] > w.stats["kept"] > 0 for w in result.windows), result.windows
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


@pytest.mark.parametrize("keeps_order", [True, False])
def test_repeats_within_a_window_are_dropped_alike_with_or_without_the_sort(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, keeps_order: bool
) -> None:
    # A parse that keeps line order lets the key lookup drop a window's repeats as the rows
    # pass; one that does not leaves them to a row_number() over the key. Same rows either way.
    generate_payments(landing, records=2_000, files=4, duplicate_rate=0.2, invalid_rate=0.05)
    assert PAYMENTS.parse is not None
    job = dataclasses.replace(
        PAYMENTS, parse=dataclasses.replace(PAYMENTS.parse, keeps_order=keeps_order)
    )
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    engine = build_engine(job, settings, spark, pg_dsn)
    result = engine.run(max_units_per_window=2)
    assert len(result.windows) == 2
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    out = engine.outputs(engine.ledger.windows()[-1])
    try:
        assert out.computed is not None
        plan = out.computed.kept._jdf.queryExecution().analyzed().toString()
        assert ("row_number" in plan) is not keeps_order
        assert (out.computed.kept_where is None) is not keeps_order
    finally:
        out.release()
