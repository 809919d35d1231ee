"""The PostgreSQL resource: where the sinks and the ledger live, never printed."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import ConfigurableResource, EnvVar

from onceflow.ops import describe_dsn, resolve_dsn

DSN_ENV = "ONCEFLOW_POSTGRES_DSN"


class PostgresResource(ConfigurableResource):
    """The PostgreSQL server holding the PostgreSQL sinks and the ledger.

    Attributes:
        dsn: A libpq DSN or URI; empty means onceflow's embedded server under the home folder.
            Give it as `EnvVar("ONCEFLOW_POSTGRES_DSN")` so the UI shows the variable's name,
            never its value.
    """

    dsn: str | None = None

    @classmethod
    def from_env(cls) -> PostgresResource:
        """The resource reading `ONCEFLOW_POSTGRES_DSN`, or the embedded server when it is unset."""
        if os.environ.get(DSN_ENV):
            return cls(dsn=EnvVar(DSN_ENV))
        return cls()

    def resolve(self, home: Path) -> str:
        """The DSN to connect with (starting the embedded server under `home` if needed)."""
        return resolve_dsn(self.dsn or None, home)

    def describe(self, home: Path) -> str:
        """Where the server is, without credentials: safe for logs and metadata."""
        return describe_dsn(self.dsn) if self.dsn else f"embedded server under {home / 'postgres'}"
