"""PostgreSQL sinks: the spec users write, and the group that owns the transactional protocol."""

from __future__ import annotations

from onceflow.sinks.postgres.group import PostgresGroup
from onceflow.sinks.postgres.spec import PG_TYPES, PostgresSink, quarantine_table

__all__ = ["PG_TYPES", "PostgresGroup", "PostgresSink", "quarantine_table"]
