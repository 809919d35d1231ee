"""A flaky network between a job and PostgreSQL slows the job down and never stops it.

Through a proxy that lets COMMITs reach the server and then cuts the connection before the
answer comes back (and, in one test, cuts other statements' answers too), every ledger, sink
and executor round trip is retried or decided by what it wrote; a server gone for longer than
`ONCEFLOW_PG_RETRY_S` fails the run with a message naming the server, never its credentials.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow.engine import Engine, build_engine
from onceflow.errors import OnceflowError, PostgresUnavailableError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.ledger import Ledger
from onceflow.reconcile import reconcile
from onceflow.settings import Settings
from onceflow.status import pending_work
from tests.support.cli import CliRun
from tests.support.latest_points import latest_points_job
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.pgproxy import PgProxy

JOB = "payments"
MAX_RUNS = 5


def make_engine(spark: Any, dsn: str, lake: Path, landing: Path, home: Path) -> Engine:
    settings = Settings(home=home, postgres_dsn=dsn, lake=lake, landing=landing)
    return build_engine(PAYMENTS, settings, spark, dsn)


def dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def balances_off_the_payments(dsn: str) -> int:
    """Merchant balances that differ from the sum and count of the stored payments."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            """
            SELECT count(*) FROM (
                SELECT merchant_id, currency, sum(amount_cents) AS total, count(*) AS n
                  FROM public.payments GROUP BY merchant_id, currency) p
            FULL JOIN public.merchant_balances b USING (merchant_id, currency)
             WHERE p.total IS DISTINCT FROM b.total_cents OR p.n IS DISTINCT FROM b.payment_count
            """
        ).fetchone()
    assert row is not None
    return int(row[0])


def label(statement: str) -> str:
    """What a transaction whose COMMIT answer was lost was doing, from its first statement."""
    for start, name in (
        ("COPY", "executor COPY into staging"),
        ("DROP TABLE IF EXISTS", "staging table DDL"),
        ("SELECT pg_advisory_xact_lock", "schema DDL"),
        ("SELECT coalesce(max(window_id)", "plan window"),
        ("INSERT INTO onceflow.jobs", "take epoch"),
        ("UPDATE onceflow.windows SET stats", "record stats"),
        ("UPDATE onceflow.windows SET completed_at", "mark completed"),
        ("SELECT 1 FROM onceflow.sink_commits", "sink commit (markers)"),
    ):
        if statement.startswith(start):
            return name
    return " ".join(statement.split()[:3])


def run_until_done(
    engine: Engine, direct: Engine, per_window: int
) -> tuple[int, list[str], list[int]]:
    """Run the job until nothing is pending (at most MAX_RUNS runs): runs, failures, windows."""
    failures: list[str] = []
    windows: list[int] = []
    for runs in range(1, MAX_RUNS + 1):
        try:
            result = engine.run(max_units_per_window=per_window)
            windows += [w.window_id for w in result.windows]
        except OnceflowError as exc:
            failures.append(f"{type(exc).__name__}: {exc.message}")
        if not pending_work(direct).any:
            return runs, failures, windows
    pytest.fail(f"still pending after {MAX_RUNS} runs; failures: {failures}")


def test_proxy_cuts_a_share_of_all_commits_after_they_committed(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (i int PRIMARY KEY)")
    lost: list[int] = []
    with PgProxy(pg_dsn) as proxy:
        proxy.flaky(commits=0.3, seed=7)
        for i in range(40):
            conn = psycopg.connect(proxy.dsn(dbname(pg_dsn)))
            conn.execute("INSERT INTO t VALUES (%s)", (i,))
            try:
                conn.commit()
            except psycopg.OperationalError:
                lost.append(i)
            conn.close()
        assert proxy.commits == 40
        assert proxy.lost("commit") == len(lost) > 0
        assert all(d.reply_bytes > 0 for d in proxy.drops)
    with psycopg.connect(pg_dsn) as direct:
        rows = direct.execute("SELECT count(*) FROM t").fetchone()
    assert rows == (40,)  # every COMMIT whose answer was cut had committed


def test_ledger_writes_are_decided_by_what_they_wrote(pg_dsn: str) -> None:
    Ledger(pg_dsn, JOB).ensure_schema()
    with PgProxy(pg_dsn) as proxy:
        ledger = Ledger(proxy.dsn(dbname(pg_dsn)), JOB)
        proxy.flaky(commits=1.0)  # every COMMIT's answer is lost; every COMMIT applies
        epoch = ledger.acquire_epoch("run-1")
        first = ledger.plan_window(epoch, {"files": ["a", "b"]}, ["a", "b"])
        second = ledger.plan_window(epoch, {"files": ["c"]}, ["c"])
        assert ledger.unplanned(["a", "b", "c", "d"]) == ["d"]
        assert proxy.lost("commit") == 3
    assert (epoch, first.window_id, second.window_id) == (1, 1, 2)
    direct = Ledger(pg_dsn, JOB)
    assert direct.current_epoch() == 1  # not taken twice
    assert [(w.window_id, w.offsets) for w in direct.windows()] == [
        (1, {"files": ["a", "b"]}),
        (2, {"files": ["c"]}),
    ]
    with psycopg.connect(pg_dsn) as conn:
        units = conn.execute("SELECT unit, window_id FROM onceflow.source_units ORDER BY unit")
        assert units.fetchall() == [("a", 1), ("b", 1), ("c", 2)]


def test_a_start_up_cut_off_before_its_commit_does_not_block_the_next(pg_dsn: str) -> None:
    ledger = Ledger(pg_dsn, JOB)
    ledger.ensure_schema()
    assert ledger.acquire_epoch("first") == 1
    # What a start-up leaves when its connection is cut before COMMIT and the server has not
    # noticed: a session without an epoch, idle in its transaction, holding the job's row lock.
    stale = psycopg.connect(pg_dsn, application_name=f"onceflow/{JOB}/new")
    stale.execute("UPDATE onceflow.jobs SET run_id = 'cut-off' WHERE job = %s", (JOB,))
    started = time.monotonic()
    assert ledger.acquire_epoch("second") == 2
    assert time.monotonic() - started < 30
    with pytest.raises(psycopg.OperationalError):
        stale.execute("SELECT 1")
    stale.close()


@pytest.mark.slow
def test_payments_through_lost_commit_answers_make_progress_and_end_exact(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=4000, files=40, duplicate_rate=0.1, invalid_rate=0.05)
    direct = make_engine(None, pg_dsn, lake, landing, tmp_path / "home")
    with PgProxy(pg_dsn) as proxy:
        proxy.flaky(commits=0.1, seed=2024)
        engine = make_engine(spark, proxy.dsn(dbname(pg_dsn)), lake, landing, tmp_path / "home")
        started = time.monotonic()
        runs, failures, windows = run_until_done(engine, direct, per_window=2)
        wall = time.monotonic() - started
        commits, lost = proxy.commits, proxy.lost("commit")
        hit = Counter(label(d.what) for d in proxy.drops)
    print(
        f"\n40 files through a proxy losing 10% of COMMIT answers: {runs} run(s), "
        f"{len(failures)} failed, {len(windows)} windows, {commits} COMMITs of which {lost} "
        f"lost their answer, {wall:.1f}s; transactions hit: {dict(hit)}"
    )
    assert lost > 0  # the network really was flaky
    assert runs == 1, failures  # a flaky network slows a run down, it does not stop it
    assert windows == list(range(1, 21))
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert balances_off_the_payments(pg_dsn) == 0


def test_a_repair_whose_commit_answer_is_lost_reports_what_it_repaired(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.05)
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    engine.run()
    with psycopg.connect(pg_dsn) as conn:
        gone = [r[0] for r in conn.execute(
            "DELETE FROM public.payments WHERE payment_id IN (SELECT payment_id FROM"
            " public.payments ORDER BY payment_id LIMIT 3) RETURNING payment_id"
        )]  # fmt: skip
    with PgProxy(pg_dsn) as proxy:
        # The repair transaction locks the sink table first; its COMMIT lands, its answer not.
        proxy.lose_commit_of("LOCK TABLE")
        through = make_engine(spark, proxy.dsn(dbname(pg_dsn)), lake, landing, tmp_path / "home")
        report = reconcile(through)
        assert proxy.lost("commit") == 1
    found = {d.sink: d for d in report.sinks if not d.clean}
    assert set(found) == {"pg_payments"}, report
    assert (found["pg_payments"].missing, found["pg_payments"].repaired) == (3, True)
    named = {dict(s.key)["payment_id"] for s in found["pg_payments"].samples}
    assert named == set(gone)
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert balances_off_the_payments(pg_dsn) == 0


@pytest.mark.slow
def test_lost_answers_to_any_statement_end_exact(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=1200, files=8, duplicate_rate=0.1, invalid_rate=0.05)
    direct = make_engine(None, pg_dsn, lake, landing, tmp_path / "home")
    with PgProxy(pg_dsn) as proxy:
        proxy.flaky(commits=0.1, replies=0.03, seed=99)
        engine = make_engine(spark, proxy.dsn(dbname(pg_dsn)), lake, landing, tmp_path / "home")
        runs, failures, _ = run_until_done(engine, direct, per_window=2)
        lost_replies = proxy.lost("reply")
        assert runs == 1, failures
        assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))

        # Damage from outside onceflow, repaired by a reconcile through the same network.
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "DELETE FROM public.payments WHERE payment_id IN"
                " (SELECT payment_id FROM public.payments ORDER BY payment_id LIMIT 5)"
            )
        report = reconcile(engine)
        lost_in_all = proxy.lost()
    print(
        f"\n8 files, 10% COMMIT and 3% other answers lost: {runs} run(s), {lost_replies} "
        f"statement answers cut; {lost_in_all} answers lost in all, reconcile included"
    )
    assert lost_replies > 0
    repaired = {d.sink: (d.missing, d.repaired) for d in report.sinks if d.missing}
    assert repaired == {"pg_payments": (5, True)}
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    assert balances_off_the_payments(pg_dsn) == 0


def test_server_gone_past_the_retry_limit_fails_the_run_clearly_and_nothing_is_lost(
    spark: Any,
    pg_dsn: str,
    lake: Path,
    landing: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generate_payments(landing, records=600, files=4, duplicate_rate=0.1, invalid_rate=0.05)
    monkeypatch.setenv("ONCEFLOW_PG_RETRY_S", "3")
    proxy = PgProxy(pg_dsn)
    dsn = proxy.dsn(dbname(pg_dsn)) + " password=s3cret-pw"
    engine = make_engine(spark, dsn, lake, landing, tmp_path / "home")

    def server_gone(result: Any) -> None:
        proxy.close()  # every connection cut; new ones refused

    started = time.monotonic()
    with pytest.raises(PostgresUnavailableError) as raised:
        engine.run(max_units_per_window=2, on_window=server_gone)
    assert time.monotonic() - started < 120
    message = raised.value.message
    assert f"database {dbname(pg_dsn)} on 127.0.0.1" in message
    assert "ONCEFLOW_PG_RETRY_S" in message and "unreachable for 3s" in message
    assert "s3cret" not in message and "password" not in message
    assert raised.value.retryable

    again = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home").run(max_units_per_window=2)
    assert [w.window_id for w in again.windows] == [2]
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_cli_run_against_an_unreachable_server_names_it_without_credentials(
    tmp_path: Path,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = {
        "PATH": "/usr/bin:/bin",
        "ONCEFLOW_HOME": str(tmp_path / "home"),
        "ONCEFLOW_LANDING": str(tmp_path / "landing"),
        "ONCEFLOW_POSTGRES_DSN": f"postgresql://etl:s3cret-pw@127.0.0.1:{port}/ledger",
        "ONCEFLOW_PG_RETRY_S": "1",
        "GX_ANALYTICS_ENABLED": "false",
        # The code under test where it is not the installed one (a worktree).
        **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
    }
    (tmp_path / "landing" / JOB).mkdir(parents=True)  # the source folder exists, empty
    done = CliRun(["run", JOB, "--json"], env, tmp_path / "logs").finish(timeout=120)
    # Retryable: the same command may succeed once the server is back (EX_TEMPFAIL).
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stderr.startswith("onceflow: run failed: could not connect")  # one paragraph
    assert "database ledger on 127.0.0.1" in done.stderr
    assert "could not connect" in done.stderr and "ONCEFLOW_PG_RETRY_S" in done.stderr
    assert "s3cret" not in done.stderr + done.stdout
    failure = json.loads(done.stdout)  # the one JSON object on stdout
    assert failure["error"] == "PostgresUnavailableError" and failure["retryable"] is True
    assert (failure["ok"], failure["exit_code"]) == (False, 75)


def test_an_upsert_sink_whose_keys_return_ends_exact_through_lost_answers(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, caplog: Any
) -> None:
    """An upsert sink inserts windows of new keys as they are and commits a window whose keys
    its table holds again as an upsert: through lost COMMIT and statement answers, in runs that
    each start by inserting, the table ends with the latest window's row of every key."""
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    job = latest_points_job({"team": "string", "points": "bigint"})
    # 24 files, one a window, in 3 runs of 8: each file brings 40 teams, some new, some back.
    folder = landing / "scores"
    folder.mkdir(parents=True)
    latest: dict[str, tuple[int, int]] = {}
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    with PgProxy(pg_dsn) as proxy:
        proxy.flaky(commits=0.25, replies=0.03, seed=7)
        engine = Engine(job, settings, spark, proxy.dsn(dbname(pg_dsn)))
        direct = Engine(job, settings, None, pg_dsn)
        for run in range(3):
            for n in range(run * 8, run * 8 + 8):
                teams = [f"t{(n * 17 + i * 7) % (60 + n * 10)}" for i in range(40)]
                teams = list(dict.fromkeys(teams))  # one row per key a window
                points = [n * 1000 + i for i in range(len(teams))]
                pq.write_table(
                    pa.table({"team": teams, "points": pa.array(points, pa.int64())}),
                    folder / f"f{n:03d}.parquet",
                )
                for team, p in zip(teams, points, strict=True):
                    latest[team] = (p, n + 1)
            with caplog.at_level(logging.INFO, logger="onceflow.sinks.postgres.commit"):
                _, failures, windows = run_until_done(engine, direct, per_window=1)
            assert sorted(windows) == list(range(run * 8 + 1, run * 8 + 9)), failures
        lost = proxy.lost()
    switched = [r for r in caplog.records if "upserts from now on" in r.getMessage()]
    assert lost > 0 and switched  # the network was flaky, and the upsert path was taken
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT team, points, _window_id FROM latest_points").fetchall()
        markers = conn.execute(
            "SELECT count(*) FROM onceflow.sink_commits WHERE job = 'latest_points'"
        ).fetchone()
    got = {team: (points, window) for team, points, window in rows}
    assert len(rows) == len(got)
    lost_keys = set(latest) - set(got)
    wrong = {t for t in set(latest) & set(got) if latest[t] != got[t]}
    extra = set(got) - set(latest)
    assert (lost_keys, wrong, extra) == (set(), set(), set())
    assert markers == (24,)
