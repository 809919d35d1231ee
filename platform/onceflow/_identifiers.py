"""Validation of SQL identifiers and the idempotency keys every sink, sensor and check shares."""

from __future__ import annotations

import re

from onceflow.errors import ConfigurationError

_PG_MAX_IDENTIFIER_BYTES = 63
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_identifier(name: str, what: str) -> str:
    """Return `name` if it is a safe SQL identifier that PostgreSQL will not truncate."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"{what} {name!r} is not a plain identifier: use letters, digits and underscores, "
            "starting with a letter or underscore."
        )
    if len(name.encode()) > _PG_MAX_IDENTIFIER_BYTES:
        raise ConfigurationError(
            f"{what} {name[:20]!r}… is {len(name.encode())} bytes long; PostgreSQL truncates names "
            f"past {_PG_MAX_IDENTIFIER_BYTES} bytes, so two long names could meet. Shorten it."
        )
    return name


def spark_sql_name(name: str) -> str:
    """`name` as a Spark SQL identifier, backquoted: any column name, taken as it is."""
    return "`" + name.replace("`", "``") + "`"


def spark_sql_string(value: str) -> str:
    """`value` as a Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def delta_app_id(job: str, sink: str) -> str:
    """The Delta application-transaction id under which `sink` records a job's windows."""
    return f"onceflow/{job}/{sink}"


def epoch_app_id(job: str, sink: str) -> str:
    """The Delta application-transaction id under which runs claim a table for their epoch."""
    return f"{delta_app_id(job, sink)}/epoch"


def restate_app_id(job: str, sink: str) -> str:
    """The Delta application-transaction id that records restatements of windows."""
    return f"{delta_app_id(job, sink)}/restate"


def session_name(job: str, epoch: int | None) -> str:
    """The PostgreSQL application name that lets a newer run find (and end) an older run's
    sessions."""
    return f"onceflow/{job}/e{epoch}" if epoch is not None else f"onceflow/{job}/new"
