"""Asset checks: a job's Great Expectations suites (`onceflow.validation`), one check per sink."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetKey,
    MetadataValue,
    multi_asset_check,
)

from assets.runs import make_engine
from onceflow import Engine, Job, ops
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from resources._annotations import typed

CHECK_NAME = "quality"
FRESHNESS_CHECK = "input_planned_in_time"


def gates(job: Job, key: AssetKey) -> bool:
    """Whether the quality check of the sink asset `key` is blocking: a lake table, which
    other jobs read as their input (payments → daily_totals). A failed check then stops the
    assets downstream of it in the same run; the PostgreSQL sinks' checks do not, so a run
    that includes the recovery asset still repairs them."""
    return job.sink(key.to_user_string()).lake_table is not None


def build_quality_checks(job: Job, keys: Sequence[AssetKey]) -> list[AssetChecksDefinition]:
    """One multi-asset check running the job's suites, with one result per sink asset.

    The suites and their rules come from the job's definition (`quality_targets`); the check
    only runs them and reports counts, never row values. The checks of the sinks other jobs
    read are blocking (`gates`).
    """

    @multi_asset_check(
        name=f"{job.name}_quality",
        specs=[
            AssetCheckSpec(
                CHECK_NAME,
                asset=key,
                description="No duplicate keys; row counts and sums equal what the ledger says.",
                blocking=gates(job, key),
            )
            for key in keys
        ],
        can_subset=True,
    )
    @typed
    def _quality(
        context: AssetCheckExecutionContext,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> Iterator[AssetCheckResult]:
        engine = make_engine(job, spark, postgres, onceflow)
        wanted = {key.asset_key.to_user_string() for key in context.selected_asset_check_keys}
        for outcome in run_quality(job, engine, wanted):
            yield AssetCheckResult(
                asset_key=AssetKey(outcome.sink),
                check_name=CHECK_NAME,
                passed=outcome.passed,
                description=outcome.description,
                metadata=outcome.metadata,
            )

    return [_quality]


@dataclass(frozen=True)
class QualityOutcome:
    """The quality check's result for one sink: counts only, never row values."""

    sink: str
    passed: bool
    description: str | None
    metadata: dict[str, Any]


def run_quality(job: Job, engine: Engine, sinks: Iterable[str]) -> list[QualityOutcome]:
    """Run the job's suites for `sinks` (the names of sink assets) on `engine`'s session.

    The suites and their rules come from the job's definition (`quality_targets`).
    """
    wanted = set(sinks)
    docs = engine.settings.home / "data_docs" / job.name
    report = ops.validate(engine, data_docs_dir=docs, sinks=wanted).report
    outcomes = []
    for sink in sorted(wanted):
        results = [r for r in report.results if r.sink == sink]
        failed = [r for r in results if not r.passed]
        metadata: dict[str, Any] = {
            "checks": MetadataValue.int(len(results)),
            "failed": MetadataValue.int(len(failed)),
            "failures": MetadataValue.json(
                [{"check": r.check, "observed": r.observed} for r in failed]
            ),
            "seconds": MetadataValue.float(
                round(_suite_seconds(report.timings, job.name, sink), 3)
            ),
            # The windows the result speaks for: every one up to this (the lineage view's
            # `checks` columns of those windows follow this result).
            "through_window": MetadataValue.int(report.through_window),
        }
        if report.data_docs:
            metadata["data_docs"] = MetadataValue.path(report.data_docs)
        outcomes.append(
            QualityOutcome(
                sink,
                passed=not failed,
                description=None if results else "no rules declared for this sink",
                metadata=metadata,
            )
        )
    return outcomes


def _suite_seconds(timings: dict[str, float], job: str, sink: str) -> float:
    """Wall time of one sink's suites: keys `<job>.<sink>` or `<job>.<sink>.<suffix>`; the
    `:spark` entries are already inside their suite's time."""
    name = f"{job}.{sink}"
    return float(
        sum(
            v
            for k, v in timings.items()
            if ":" not in k and (k == name or k.startswith(name + "."))
        )
    )


def build_freshness_checks(job: Job, keys: Sequence[AssetKey]) -> list[AssetChecksDefinition]:
    """One check per sink asset that fails while input older than the job's `freshness_s` is
    visible but planned into no window: the sinks are green yet behind (no Spark needed)."""

    @multi_asset_check(
        name=f"{job.name}_freshness",
        specs=[
            AssetCheckSpec(
                FRESHNESS_CHECK,
                asset=key,
                description=(
                    f"No input waits longer than {job.freshness_s:g}s before a window plans it."
                ),
            )
            for key in keys
        ],
        can_subset=True,
    )
    @typed
    def _freshness(
        context: AssetCheckExecutionContext,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> Iterator[AssetCheckResult]:
        settings = onceflow.settings()
        engine = ops.open_engine(job, settings, dsn=postgres.resolve(settings.home))
        found = run_freshness(engine)
        for key in context.selected_asset_check_keys:
            yield AssetCheckResult(
                asset_key=key.asset_key,
                check_name=FRESHNESS_CHECK,
                passed=found.passed,
                severity=found.severity,
                description=found.description,
                metadata=found.metadata,
            )

    return [_freshness]


@dataclass(frozen=True)
class FreshnessOutcome:
    """The freshness check's result, the same for every sink asset of a job."""

    passed: bool
    severity: AssetCheckSeverity
    description: str | None
    metadata: dict[str, Any]


def run_freshness(engine: Engine) -> FreshnessOutcome:
    """Evaluate the freshness check on `engine` (no Spark needed): stale input is an error,
    committed input that changed since is a warning."""
    found = ops.freshness(engine)
    age = found.oldest_unplanned_age_s
    stale = (
        None
        if found.fresh
        else (
            f"{found.unplanned} input unit(s) unplanned, the oldest for {age or 0:.0f}s "
            f"(bound {found.bound_s:g}s): no run has taken them."
        )
    )
    # Committed input that changed is a warning: nothing waits, but a change is lost.
    changed = ops.changed_input_message(engine.job.name, found.changed) if found.changed else None
    return FreshnessOutcome(
        passed=found.fresh and not found.changed,
        severity=AssetCheckSeverity.ERROR if not found.fresh else AssetCheckSeverity.WARN,
        description=" ".join(text for text in (stale, changed) if text) or None,
        metadata={
            "unplanned_units": MetadataValue.int(found.unplanned),
            "oldest_unplanned_age_s": MetadataValue.float(round(float(age or 0.0), 1)),
            "freshness_s": MetadataValue.float(float(found.bound_s)),
            "changed_units": MetadataValue.int(len(found.changed)),
            "changed": MetadataValue.json(
                [
                    {"unit": c.unit, "window_id": c.window_id, "detail": c.detail}
                    for c in found.changed[:20]
                ]
            ),
        },
    )
