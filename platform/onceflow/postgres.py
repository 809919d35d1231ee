"""Connections to PostgreSQL: the embedded server, DSN redaction, and error translation."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import psycopg
from psycopg import conninfo

from onceflow.errors import ConfigurationError

_log = logging.getLogger(__name__)

# How long a connection attempt may take before the job reports the server unreachable.
CONNECT_TIMEOUT_S = 10
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


def embedded_dsn(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL server under `home` and return its DSN."""
    import pgserver

    data = home / "postgres"
    data.mkdir(parents=True, exist_ok=True)
    try:
        server = pgserver.get_server(data, cleanup_mode="stop")
    except Exception as exc:  # pgserver raises assorted subprocess and OS errors
        raise ConfigurationError(
            f"the embedded PostgreSQL server under {data} did not start ({type(exc).__name__}); "
            "see its log in that folder, or set ONCEFLOW_POSTGRES_DSN to a server of yours."
        ) from None
    return str(server.get_uri())


def connect(
    dsn: str, *, autocommit: bool = False, application_name: str = "onceflow"
) -> psycopg.Connection:
    """Open a connection, turning failures into a ConfigurationError that hides credentials."""
    try:
        return psycopg.connect(
            dsn,
            autocommit=autocommit,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        reason = redact(
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        )
        raise ConfigurationError(
            f"cannot connect to PostgreSQL ({describe_dsn(dsn)}): {reason}. Check "
            "ONCEFLOW_POSTGRES_DSN, or unset it to use the embedded server."
        ) from None
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            "ONCEFLOW_POSTGRES_DSN is not a valid libpq DSN or URI; write it as "
            "'postgresql://user@host:5432/db' or 'host=... dbname=...'."
        ) from None


def resolve_dsn(postgres_dsn: str | None, home: Path) -> str:
    """The DSN to use: the configured one, or the embedded server's."""
    return postgres_dsn if postgres_dsn else embedded_dsn(home)
