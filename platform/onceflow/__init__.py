"""onceflow: exactly-once Spark jobs into Delta Lake and PostgreSQL."""

from __future__ import annotations

from onceflow.engine import Engine, RunResult, SinkOutcome, WindowResult, build_engine
from onceflow.errors import (
    CommitUnknownError,
    ConfigurationError,
    FencedError,
    LedgerError,
    OnceflowError,
    SinkError,
    SourceError,
    TransientSinkError,
    UnverifiableWindowError,
)
from onceflow.job import (
    Dedupe,
    DeltaSink,
    Guarantee,
    Job,
    PostgresSink,
    WindowContext,
)
from onceflow.jobs import get_job
from onceflow.ledger import Ledger, Window
from onceflow.restate import restate_window
from onceflow.settings import Settings
from onceflow.sources import LandingSource
from onceflow.spark import build_spark_session

__version__ = "0.1.0"

__all__ = [
    "CommitUnknownError",
    "ConfigurationError",
    "Dedupe",
    "DeltaSink",
    "Engine",
    "FencedError",
    "Guarantee",
    "Job",
    "LandingSource",
    "Ledger",
    "LedgerError",
    "OnceflowError",
    "PostgresSink",
    "RunResult",
    "Settings",
    "SinkError",
    "SinkOutcome",
    "SourceError",
    "TransientSinkError",
    "UnverifiableWindowError",
    "Window",
    "WindowContext",
    "WindowResult",
    "build_engine",
    "build_spark_session",
    "get_job",
    "restate_window",
]
