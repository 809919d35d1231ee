"""Connections to PostgreSQL: the embedded server, DSN redaction, error translation, and the
retries that let a job ride out a lost connection."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo

from onceflow.errors import ConfigurationError, PostgresUnavailableError

_log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a connection attempt may take before the job reports the server unreachable.
CONNECT_TIMEOUT_S = 10
# How long PostgreSQL work that failed on a lost connection is retried before the run gives up.
RETRY_ENV = "ONCEFLOW_PG_RETRY_S"
DEFAULT_RETRY_S = 60.0
# A run's first connection is retried for at most this long: nothing is under way yet.
STARTUP_RETRY_S = 10.0
# Backoff between attempts: doubling from the first delay up to the cap, with jitter.
FIRST_RETRY_DELAY_S = 0.05
MAX_RETRY_DELAY_S = 5.0
# SQLSTATEs that end the session while the server stays (or soon is again) reachable: admin or
# crash shutdown, starting up, idle-session timeouts, too many connections; and class 08.
_SESSION_GONE = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "53300"})
# A failed connection attempt that no retry can fix: wrong credentials, database or role, or an
# access rule. libpq reports these without a SQLSTATE, so they are told by the server's words.
_CONFIG_FAILURES = re.compile(
    r"does not exist|authentication failed|no pg_hba\.conf entry|no password supplied|"
    r"password|permission denied|not permitted to log in|not currently accepting connections|"
    r"does not support SSL|unsupported frontend protocol|invalid value for parameter|"
    r"unrecognized configuration parameter|certificate",
    re.IGNORECASE,
)
_PASSWORD_IN_URI = re.compile(r"(://[^:/@]*:)[^@]*@")
_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """Remove passwords from a DSN or from any message that may quote one."""
    return _PASSWORD_KV.sub(r"\1***", _PASSWORD_IN_URI.sub(r"\1***@", text))


def describe_dsn(dsn: str) -> str:
    """A printable description of where `dsn` points: host and database, never credentials."""
    try:
        parts = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DSN>"
    host = parts.get("host") or "localhost"
    return f"database {parts.get('dbname') or parts.get('user') or '?'} on {host}"


def database_uri(dsn: str) -> str:
    """`postgresql://host[:port]/database` of `dsn`, without user or password: an address for
    catalogs and metadata. A Unix-socket folder is shown as `localhost`."""
    try:
        parts = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql://unknown"
    host = str(parts.get("host") or "localhost")
    if host.startswith("/"):
        host = "localhost"
    port = str(parts.get("port") or "")
    netloc = f"{host}:{port}" if port and port != "5432" else host
    return f"postgresql://{netloc}/{parts.get('dbname') or 'postgres'}"


def _import_pgserver() -> Any:
    """`pgserver`, imported without its platformdirs warning.

    pgserver asks platformdirs for a per-user runtime folder when it is imported (for its lock
    file and socket folder); where `XDG_RUNTIME_DIR` is unset (containers, cron, CI) platformdirs
    warns and falls back to `/run/user/<uid>` or a private temporary folder, which serves
    pgserver as well. The folder is not moved here: every process sharing the embedded server
    must find the same lock file. Only that warning is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"XDG_RUNTIME_DIR", category=UserWarning)
        import pgserver

    return pgserver


# The embedded servers this process holds, by data folder: released by `release_embedded`.
_HELD: dict[Path, Any] = {}


def embedded_dsn(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL server under `home` and return its DSN.

    pgserver stops the server when the last process holding it lets go (`release_embedded`,
    or its exit handler). A process killed before it could (SIGKILL) stays on pgserver's list
    and would keep the server running for good: dead processes are taken off it first.
    """
    pgserver = _import_pgserver()

    data = home / "postgres"
    data.mkdir(parents=True, exist_ok=True)
    _forget_dead_holders(data)
    try:
        server = pgserver.get_server(data, cleanup_mode="stop")
    except Exception as exc:  # pgserver raises assorted subprocess and OS errors
        raise ConfigurationError(
            f"the embedded PostgreSQL server under {data} did not start ({type(exc).__name__}); "
            "see its log in that folder, or set ONCEFLOW_POSTGRES_DSN to a server of yours."
        ) from None
    _HELD[data.resolve()] = server
    return str(server.get_uri())


def release_embedded() -> None:
    """Let go of every embedded server this process holds: each stops unless another live
    process (a `dagster dev`, another run) still uses it. Called on every exit of a command."""
    while _HELD:
        data, server = _HELD.popitem()
        _forget_dead_holders(data)
        try:
            server.cleanup()
        except Exception:  # exiting anyway: pgserver's own exit handler tries again
            _log.debug("could not stop the embedded server under %s", data, exc_info=True)


def _forget_dead_holders(data: Path) -> None:
    """Take processes that no longer run off pgserver's list of the server's holders."""
    import psutil
    from pgserver.postgres_server import PostgresServer

    listed = data / ".handle_pids.json"
    with PostgresServer._lock:
        try:
            pids = [int(p) for p in json.loads(listed.read_text())]
        except (OSError, ValueError, TypeError):
            return
        alive = [p for p in pids if _running(psutil, p)]
        if alive != pids:
            listed.write_text(json.dumps(alive))


def _running(psutil: Any, pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it runs
        return True


def stop_embedded(home: Path) -> bool:
    """Release this process's hold on the embedded server under `home`; it stops unless another
    process (a `dagster dev`, another run) still uses it. Returns whether it is stopped."""
    import pgserver

    data = home / "postgres"
    if not (data / "postmaster.pid").exists():
        return True
    pgserver.get_server(data, cleanup_mode="stop").cleanup()
    return not (data / "postmaster.pid").exists()


def connect(
    dsn: str,
    *,
    autocommit: bool = False,
    application_name: str = "onceflow",
    settings: Mapping[str, str] | None = None,
) -> psycopg.Connection:
    """Open a connection.

    `settings` are server settings given in the startup packet (`-c name=value`), so they hold
    from the first statement without a round trip; they are added to any `options` of the DSN.

    Raises:
        ConfigurationError: The DSN is malformed, or the server refused it for good (credentials,
            unknown database or role, access rules); credentials are never quoted.
        psycopg.OperationalError: The server could not be reached (refused, reset, timed out,
            starting up): a lost connection that `retrying` retries.
    """
    extra: dict[str, str] = {}
    if settings:
        given = _dsn_options(dsn)
        ours = " ".join(f"-c {name}={value}" for name, value in settings.items())
        extra["options"] = f"{given} {ours}".strip()
    try:
        return psycopg.connect(
            dsn,
            autocommit=autocommit,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=application_name,
            **extra,
        )
    except psycopg.OperationalError as exc:
        if is_lost_connection(exc):
            raise
        raise ConfigurationError(
            f"cannot connect to PostgreSQL ({describe_dsn(dsn)}): {_first_line(exc)}. Check "
            "ONCEFLOW_POSTGRES_DSN, or unset it to use the embedded server."
        ) from None
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            "ONCEFLOW_POSTGRES_DSN is not a valid libpq DSN or URI; write it as "
            "'postgresql://user@host:5432/db' or 'host=... dbname=...'."
        ) from None


class Sessions:
    """Connections to one server, kept open for reuse while `kept()` is active.

    A window's ledger reads and writes are many short round trips. A new session for each costs
    the server a backend start (2–3 ms on a local socket, more with TLS and a password) and the
    client the wait for it. Inside `kept()` (a run's windows), a session that ends idle and open
    is kept for the next one opened the same way (autocommit, application name, settings); an
    error closes it, so the next attempt of `retrying` starts a new one. Outside `kept()`, each
    session is opened and closed as `connect` does, so nothing stays open between runs.

    Thread-safe: a connection is used by one thread at a time.
    """

    # A kept connection idle longer than this is pinged before use: a restarted server or a
    # dropped network path is then met by a new connection, not a retry after a backoff.
    PING_AFTER_S = 5.0
    # A kept connection idle longer than this is closed rather than reused: a process that
    # keeps sessions for good (`process_sessions`) does not hold a finished run's for long.
    CLOSE_AFTER_S = 30.0

    def __init__(self, dsn: str, *, always_kept: bool = False, max_idle: int | None = None) -> None:
        """`always_kept`: keep sessions as if inside `kept()` for good. `max_idle`: keep at
        most this many idle sessions in all (the longest idle is closed first)."""
        self._dsn = dsn
        self._lock = threading.Lock()
        self._depth = 1 if always_kept else 0
        self._max_idle = max_idle
        self._idle: dict[tuple[Any, ...], list[tuple[psycopg.Connection, float]]] = {}
        self._pid = os.getpid()

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Keep connections for reuse until the outermost `kept()` ends, then close them."""
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                idle = self._take_all() if self._depth == 0 else []
            for conn in idle:
                conn.close()

    @contextmanager
    def session(
        self,
        *,
        autocommit: bool = False,
        application_name: str = "onceflow",
        settings: Mapping[str, str] | None = None,
    ) -> Iterator[psycopg.Connection]:
        """A connection as `connect` opens it, committed on leaving (as `with connect()`
        commits), rolled back and closed on an error."""
        key = (autocommit, application_name, tuple(sorted((settings or {}).items())))
        conn = self._reuse(key) or connect(
            self._dsn, autocommit=autocommit, application_name=application_name, settings=settings
        )
        try:
            yield conn
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
                conn.commit()
        except BaseException:
            conn.close()
            raise
        idle = psycopg.pq.TransactionStatus.IDLE
        with self._lock:
            keep = self._depth > 0 and not conn.closed and conn.info.transaction_status == idle
            if keep:
                self._idle.setdefault(key, []).append((conn, time.monotonic()))
            stale = self._take_stale()
        if not keep:
            conn.close()
        for old in stale:
            old.close()

    def close_idle(self) -> None:
        """Close every kept session that is idle now."""
        with self._lock:
            idle = self._take_all()
        for conn in idle:
            conn.close()

    def _reuse(self, key: tuple[Any, ...]) -> psycopg.Connection | None:
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the parent's sockets are not ours
                self._idle.clear()
                self._pid = os.getpid()
            kept = self._idle.get(key)
            if not kept:
                return None
            conn, since = kept.pop()
        idle_s = time.monotonic() - since
        if idle_s > self.CLOSE_AFTER_S:
            conn.close()
            return None
        if idle_s > self.PING_AFTER_S:
            try:
                conn.execute("SELECT 1")
                if not conn.autocommit:
                    conn.rollback()
            except psycopg.Error:
                conn.close()
                return None
        return conn

    def _take_stale(self) -> list[psycopg.Connection]:
        """The kept connections idle longer than CLOSE_AFTER_S, and the longest idle beyond
        `max_idle`, no longer kept (under the lock)."""
        cutoff = time.monotonic() - self.CLOSE_AFTER_S
        by_age = sorted(
            ((since, key, conn) for key, kept in self._idle.items() for conn, since in kept),
            key=lambda entry: entry[0],
            reverse=True,
        )
        room = len(by_age) if self._max_idle is None else self._max_idle
        self._idle = {}
        stale: list[psycopg.Connection] = []
        for since, key, conn in by_age:
            if since < cutoff or room == 0:
                stale.append(conn)
                continue
            room -= 1
            self._idle.setdefault(key, []).insert(0, (conn, since))
        return stale if os.getpid() == self._pid else []

    def _take_all(self) -> list[psycopg.Connection]:
        idle = [conn for kept in self._idle.values() for conn, _ in kept]
        self._idle.clear()
        return idle if os.getpid() == self._pid else []


# The idle sessions a process keeps for good, in all: a window's COPYs and key lookups.
PROCESS_MAX_IDLE = 4
_process_sessions: dict[str, Sessions] = {}
_process_lock = threading.Lock()


def process_sessions(dsn: str) -> Sessions:
    """Sessions to `dsn` kept for reuse for the life of this process.

    For Spark's Python workers: a worker runs one window's task after another, and each task's
    COPYs and key lookups would otherwise start a backend of their own (a few milliseconds of
    the server's CPU and of the task's wait, several times a window). A session is kept only
    while idle outside a transaction, for at most `Sessions.CLOSE_AFTER_S`, and at most
    PROCESS_MAX_IDLE of them; asking for another DSN closes the idle sessions of the others,
    so a worker that serves run after run, each on its own database, holds no more."""
    with _process_lock:
        others = [s for other, s in _process_sessions.items() if other != dsn]
        sessions = _process_sessions.get(dsn)
        if sessions is None:
            sessions = Sessions(dsn, always_kept=True, max_idle=PROCESS_MAX_IDLE)
            _process_sessions[dsn] = sessions
    for other in others:
        other.close_idle()
    return sessions


def _dsn_options(dsn: str) -> str:
    try:
        return str(conninfo.conninfo_to_dict(dsn).get("options") or "")
    except psycopg.ProgrammingError:
        return ""  # connect() reports the malformed DSN


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return redact(text.splitlines()[0] if text else type(exc).__name__)


def is_lost_connection(exc: BaseException) -> bool:
    """Whether `exc` means the connection is gone (or could not be made) for a reason that may
    pass: the network, a restart or failover of the server, a session ended by the server.

    Not: SQL errors, constraint violations, lock or statement timeouts, wrong credentials.
    """
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is not None:
        return state.startswith("08") or state in _SESSION_GONE
    if isinstance(exc, psycopg.InterfaceError):
        text = str(exc).lower()
        return "connection" in text and ("closed" in text or "lost" in text)
    # libpq's own errors (server closed the connection unexpectedly, SSL SYSCALL error,
    # connection refused or timed out, the connection is closed) carry no SQLSTATE; so do
    # failed connection attempts, some of which are for good.
    return isinstance(exc, psycopg.OperationalError) and not _CONFIG_FAILURES.search(str(exc))


def retry_deadline_s() -> float:
    """How long lost-connection failures are retried (`ONCEFLOW_PG_RETRY_S`, default 60 s)."""
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigurationError(
            f"{RETRY_ENV}={raw!r}: give the seconds to keep retrying PostgreSQL work after a lost "
            "connection, as a number >= 0."
        )
    return value


def retry_delays(deadline_s: float) -> Callable[[], float | None]:
    """A backoff schedule: each call gives the next delay, or None once `deadline_s` has passed
    since the first call. Delays double from FIRST_RETRY_DELAY_S to MAX_RETRY_DELAY_S with
    jitter (so the runs and executors that lost the server do not come back in step)."""
    ends = time.monotonic() + deadline_s
    step = [FIRST_RETRY_DELAY_S]

    def next_delay() -> float | None:
        left = ends - time.monotonic()
        if left <= 0:
            return None
        delay = min(step[0] * random.uniform(0.5, 1.0), left)
        step[0] = min(step[0] * 2, MAX_RETRY_DELAY_S)
        return delay

    return next_delay


def retrying(
    op: Callable[[], T],
    *,
    what: str,
    dsn: str,
    deadline_s: float | None = None,
    quiet: bool = False,
) -> T:
    """Run `op`, again after a lost connection, with backoff, until `deadline_s` (default
    `ONCEFLOW_PG_RETRY_S`) has passed since the first loss.

    `op` must open its own connection and be safe to run again: read-only work, idempotent
    writes, or writes that first decide whether an earlier attempt was applied. Other errors
    pass through at once. The first retry is logged as a warning (unless `quiet`), later ones
    at INFO.

    Raises:
        PostgresUnavailableError: The server stayed unreachable past the deadline; the message
            names `what` and the server (never credentials).
    """
    delays: Callable[[], float | None] | None = None
    attempts = 0
    while True:
        attempts += 1
        try:
            return op()
        except Exception as exc:
            if not is_lost_connection(exc):
                raise
            if delays is None:
                limit = retry_deadline_s() if deadline_s is None else deadline_s
                delays = retry_delays(limit)
            delay = delays()
            reason = _first_line(exc)
            if delay is None:
                raise PostgresUnavailableError(
                    f"could not {what}: PostgreSQL ({describe_dsn(dsn)}) stayed unreachable for "
                    f"{limit:g}s ({attempts} attempt(s); the limit is {RETRY_ENV}); last error: "
                    f"{reason}. Run the job again once the server is reachable: it resumes "
                    "where this run stopped."
                ) from None
            _log.log(
                logging.INFO if quiet or attempts > 1 else logging.WARNING,
                "lost the connection to PostgreSQL (%s) while trying to %s (%s); retrying for "
                "up to %gs",
                describe_dsn(dsn),
                what,
                reason,
                limit,
            )
            time.sleep(delay)


def check_reachable(dsn: str) -> None:
    """Connect once before a run starts Spark: a server that is wrong fails at once
    (ConfigurationError); one that is down (or restarting) is retried quietly for at most
    STARTUP_RETRY_S, then fails (PostgresUnavailableError)."""
    deadline = min(STARTUP_RETRY_S, retry_deadline_s())
    retrying(lambda: connect(dsn).close(), what="connect", dsn=dsn, deadline_s=deadline, quiet=True)


def resolve_dsn(postgres_dsn: str | None, home: Path) -> str:
    """The DSN to use: the configured one, or the embedded server's."""
    return postgres_dsn if postgres_dsn else embedded_dsn(home)


def refusal_details(exc: psycopg.Error) -> str:
    """The identifiers in the server's diagnostics of `exc` (schema, table, column, constraint,
    data type): they name what was refused, never a row's values (which DETAIL may quote)."""
    diag: Any = exc.diag
    parts = []
    table = ".".join(p for p in (diag.schema_name, diag.table_name) if p)
    if table:
        parts.append(f"table {table}")
    for label, value in (
        ("column", diag.column_name),
        ("constraint", diag.constraint_name),
        ("type", diag.datatype_name),
    ):
        if value:
            parts.append(f"{label} {value}")
    return ", ".join(parts)
