"""onceflow.postgres: which errors are a lost connection, the retry helper, and connecting."""

from __future__ import annotations

import socket
import time
from typing import Any

import psycopg
import pytest

from onceflow import postgres
from onceflow.errors import ConfigurationError, PostgresUnavailableError
from onceflow.postgres import Sessions, check_reachable, connect, is_lost_connection, retrying


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg.OperationalError("SSL SYSCALL error: EOF detected"), True),
        (psycopg.OperationalError("consuming input failed: the connection is closed"), True),
        (psycopg.OperationalError('connection to server at "h", port 1 failed: refused'), True),
        (psycopg.errors.AdminShutdown("terminating connection"), True),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), True),
        (psycopg.errors.ConnectionFailure("x"), True),
        (psycopg.errors.IdleInTransactionSessionTimeout("x"), True),
        (psycopg.InterfaceError("the connection is closed"), True),
        (psycopg.OperationalError('FATAL:  password authentication failed for user "u"'), False),
        (psycopg.OperationalError('FATAL:  database "nope" does not exist'), False),
        (psycopg.errors.UniqueViolation("duplicate key"), False),
        (psycopg.errors.LockNotAvailable("lock timeout"), False),
        (psycopg.errors.QueryCanceled("statement timeout"), False),
        (psycopg.errors.SyntaxError("x"), False),
        (ValueError("x"), False),
    ],
)
def test_lost_connections_are_told_from_other_errors(error: Exception, lost: bool) -> None:
    assert is_lost_connection(error) is lost


def test_retrying_does_the_work_again_after_a_lost_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(postgres, "FIRST_RETRY_DELAY_S", 0.001)
    calls: list[int] = []

    def op() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return "done"

    assert retrying(op, what="read", dsn="host=h dbname=d", deadline_s=10) == "done"
    assert len(calls) == 3


def test_retrying_lets_other_errors_through_at_once() -> None:
    calls: list[int] = []

    def op() -> None:
        calls.append(1)
        raise psycopg.errors.UniqueViolation("duplicate key")

    with pytest.raises(psycopg.errors.UniqueViolation):
        retrying(op, what="write", dsn="host=h dbname=d", deadline_s=10)
    assert len(calls) == 1


def test_retrying_gives_up_after_the_deadline_naming_the_server_not_the_password() -> None:
    dsn = "postgresql://etl:s3cret@db.example:5432/ledger"

    def op() -> Any:
        raise psycopg.OperationalError(
            'connection to server at "db.example", port 5432 failed: Connection refused'
        )

    started = time.monotonic()
    with pytest.raises(PostgresUnavailableError) as raised:
        retrying(op, what="plan a window", dsn=dsn, deadline_s=0.3)
    assert 0.3 <= time.monotonic() - started < 3
    message = raised.value.message
    assert "could not plan a window" in message
    assert "database ledger on db.example" in message
    assert "ONCEFLOW_PG_RETRY_S" in message and "Connection refused" in message
    assert "s3cret" not in message
    assert raised.value.retryable


def test_retry_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEFLOW_PG_RETRY_S", "2.5")
    assert postgres.retry_deadline_s() == 2.5
    monkeypatch.setenv("ONCEFLOW_PG_RETRY_S", "soon")
    with pytest.raises(ConfigurationError, match="ONCEFLOW_PG_RETRY_S"):
        postgres.retry_deadline_s()


def test_backoff_doubles_with_jitter_and_stops_at_the_deadline() -> None:
    delays = postgres.retry_delays(60)
    got = [delays() for _ in range(12)]
    assert all(d is not None for d in got)
    assert got[0] <= postgres.FIRST_RETRY_DELAY_S  # type: ignore[operator]
    assert max(got) <= postgres.MAX_RETRY_DELAY_S  # type: ignore[type-var]
    assert got[-1] >= postgres.MAX_RETRY_DELAY_S / 2  # type: ignore[operator]
    over = postgres.retry_delays(0)
    assert over() is None


def test_a_refused_connection_is_retryable_but_a_wrong_database_fails_at_once(
    pg_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = f"host=127.0.0.1 port={_closed_port()} dbname=ledger user=etl password=s3cret"
    with pytest.raises(psycopg.OperationalError) as raised:
        connect(refused)
    assert is_lost_connection(raised.value)

    monkeypatch.setenv("ONCEFLOW_PG_RETRY_S", "0.5")
    with pytest.raises(PostgresUnavailableError) as unreachable:
        check_reachable(refused)
    assert "database ledger on 127.0.0.1" in unreachable.value.message
    assert "s3cret" not in unreachable.value.message

    info = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    info["dbname"] = "no_such_database"
    wrong = psycopg.conninfo.make_conninfo(**info)
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="no_such_database"):
        check_reachable(wrong)
    assert time.monotonic() - started < 5


def test_connection_settings_go_in_the_startup_packet(pg_dsn: str) -> None:
    with connect(pg_dsn, settings={"idle_in_transaction_session_timeout": "7s"}) as conn:
        row = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
        assert row == ("7s",)


def _pid(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _open_sessions(dsn: str, name: str) -> int:
    with connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    return int(row[0]) if row else 0


def _left_open(dsn: str, name: str, within: float = 10.0) -> int:
    """The sessions named `name` still open once they had `within` seconds to close: a closed
    connection's server process leaves `pg_stat_activity` a moment after the client is gone."""
    deadline = time.monotonic() + within
    while (count := _open_sessions(dsn, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def test_sessions_are_reused_only_inside_kept_and_closed_when_it_ends(pg_dsn: str) -> None:
    sessions = Sessions(pg_dsn)
    with sessions.session(application_name="s-out") as conn:
        outside = _pid(conn)
    with sessions.session(application_name="s-out") as conn:
        assert _pid(conn) != outside  # not kept: a new session each time
    assert _left_open(pg_dsn, "s-out") == 0
    with sessions.kept():
        with sessions.session(application_name="s-in") as conn:
            first = _pid(conn)
        with sessions.session(application_name="s-in") as conn:
            assert _pid(conn) == first
            with sessions.session(application_name="s-in") as other:  # in use: another one
                assert _pid(other) != first
        with sessions.session(autocommit=True, application_name="s-in") as conn:
            assert _pid(conn) not in {first}  # opened another way: not shared
        assert _open_sessions(pg_dsn, "s-in") == 3
    assert _left_open(pg_dsn, "s-in") == 0


def test_a_kept_session_commits_on_leaving_and_an_error_ends_it(pg_dsn: str) -> None:
    sessions = Sessions(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept_rows (n int)")
    with sessions.kept():
        with sessions.session(application_name="s-tx") as conn:
            conn.execute("INSERT INTO kept_rows VALUES (1)")
            first = _pid(conn)
        with pytest.raises(psycopg.errors.DivisionByZero):
            with sessions.session(application_name="s-tx") as conn:
                assert _pid(conn) == first
                conn.execute("INSERT INTO kept_rows VALUES (2)")
                conn.execute("SELECT 1 / 0")
        assert conn.closed
        with sessions.session(application_name="s-tx") as conn:
            assert _pid(conn) != first
            rows = conn.execute("SELECT n FROM kept_rows").fetchall()
    assert rows == [(1,)]


def test_a_kept_session_the_server_ended_is_replaced(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = Sessions(pg_dsn)
    monkeypatch.setattr(Sessions, "PING_AFTER_S", 0.0)
    with sessions.kept():
        with sessions.session(autocommit=True, application_name="s-gone") as conn:
            gone = _pid(conn)
        with connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (gone,))
        time.sleep(0.2)
        with sessions.session(autocommit=True, application_name="s-gone") as conn:
            assert _pid(conn) != gone


def test_process_sessions_keep_few_idle_and_close_them_once_old(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "PROCESS_MAX_IDLE", 2)
    monkeypatch.setattr(postgres, "_process_sessions", {})
    sessions = postgres.process_sessions(pg_dsn)
    assert postgres.process_sessions(pg_dsn) is sessions  # one set a DSN, always kept
    with (
        sessions.session(application_name="s-proc") as a,
        sessions.session(application_name="s-proc") as b,
        sessions.session(autocommit=True, application_name="s-proc") as c,
    ):
        pids = {_pid(a), _pid(b), _pid(c)}
    assert len(pids) == 3
    # c, left first, idled longest: over the limit, it was closed.
    assert c.closed and not a.closed and not b.closed
    assert _open_sessions(pg_dsn, "s-proc") == 2
    with sessions.session(application_name="s-proc") as conn:
        assert conn in (a, b)  # reused, with no backend started
    monkeypatch.setattr(Sessions, "CLOSE_AFTER_S", 0.0)
    with sessions.session(application_name="s-proc") as conn:
        assert _pid(conn) not in pids  # too old to reuse: closed, and a new one opened
    # Leaving it closed every idle one (all older than CLOSE_AFTER_S by now).
    assert _left_open(pg_dsn, "s-proc") == 0


def test_process_sessions_of_another_dsn_close_the_idle_ones_of_the_first(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "_process_sessions", {})
    with postgres.process_sessions(pg_dsn).session(application_name="s-first"):
        pass
    assert _open_sessions(pg_dsn, "s-first") == 1
    postgres.process_sessions(pg_dsn + " application_name=other")
    assert _left_open(pg_dsn, "s-first") == 0
