"""onceflow: exactly-once Spark jobs into Delta Lake and PostgreSQL.

A job is data: a source, an optional parse step, a transform and sinks.

    from onceflow import CsvSource, Job, PostgresSink

    ORDERS = Job(
        name="orders",
        source=CsvSource("orders", schema={"order_id": "string", "amount": "bigint"}),
        transform=lambda rows, ctx: {"orders": rows.select("order_id", "amount")},
        sinks=(PostgresSink("pg_orders", "orders", table="orders",
                            columns={"order_id": "text", "amount": "bigint"},
                            key=("order_id",), mode="upsert"),),
    )
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceflow.engine import BackfillResult, Engine, RunResult, WindowResult, build_engine
from onceflow.errors import (
    CommitUnknownError,
    ConfigurationError,
    FencedError,
    LedgerError,
    OnceflowError,
    SinkError,
    SourceError,
    TransientSinkError,
    UnsupportedTableError,
    UnverifiableWindowError,
)
from onceflow.job import Dedupe, Guarantee, Job, WindowContext
from onceflow.ledger import Ledger, Window
from onceflow.registry import JobSet, get_job, load_jobs
from onceflow.restate import restate_windows
from onceflow.settings import Settings
from onceflow.sinks import SinkOutcome, SinkSpec
from onceflow.sinks.delta import DeltaSink
from onceflow.sinks.postgres import PostgresSink, quarantine_table
from onceflow.sources import ArrowParse, LandingSource, Observation, Source
from onceflow.spark import build_spark_session

if TYPE_CHECKING:
    from onceflow.sources import CsvSource, DeltaTableSource, ParquetSource

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("CsvSource", "DeltaTableSource", "ParquetSource"):
        import onceflow.sources

        return getattr(onceflow.sources, name)
    raise AttributeError(f"module 'onceflow' has no attribute {name!r}")


__all__ = [
    "ArrowParse",
    "BackfillResult",
    "CommitUnknownError",
    "ConfigurationError",
    "CsvSource",
    "Dedupe",
    "DeltaSink",
    "DeltaTableSource",
    "Engine",
    "FencedError",
    "Guarantee",
    "Job",
    "JobSet",
    "LandingSource",
    "Ledger",
    "LedgerError",
    "Observation",
    "OnceflowError",
    "ParquetSource",
    "PostgresSink",
    "RunResult",
    "Settings",
    "SinkError",
    "SinkOutcome",
    "SinkSpec",
    "Source",
    "SourceError",
    "TransientSinkError",
    "UnsupportedTableError",
    "UnverifiableWindowError",
    "Window",
    "WindowContext",
    "WindowResult",
    "build_engine",
    "build_spark_session",
    "get_job",
    "load_jobs",
    "quarantine_table",
    "restate_windows",
]
