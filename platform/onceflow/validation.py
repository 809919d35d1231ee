"""A job's quality suites, derived from its sinks, and how to run them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onceflow.engine import Engine
    from onceflow.quality import Target, ValidationReport


def quality_targets(engine: Engine) -> list[Target]:
    """Every sink group's suites: keys unique, row counts and sums equal what the ledger says,
    value rules from the job's `metadata["regex"]`, sum checks from `metadata["sums"]`."""
    return [target for group in engine.groups for target in group.quality_targets()]


def validate_job(engine: Engine, data_docs_dir: Path | None = None) -> ValidationReport:
    """Run the job's Great Expectations suites against its sinks."""
    from onceflow.quality import validate

    engine.prepare()
    docs = data_docs_dir or engine.settings.home / "data_docs" / engine.job.name
    return validate(
        engine.job.name,
        quality_targets(engine),
        dsn=engine.dsn,
        spark=engine.spark,
        data_docs_dir=docs,
    )
