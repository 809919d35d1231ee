"""Builds a job's Dagster definitions (assets, checks, jobs, sensors, schedule) from its Job."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AssetSelection,
    AssetSpec,
    DataVersion,
    JobDefinition,
    MaterializeResult,
    MetadataValue,
    ObserveResult,
    ScheduleDefinition,
    SensorDefinition,
    asset,
    define_asset_job,
    in_process_executor,
    multi_asset,
    observable_source_asset,
)

from assets.catalog import (
    LINEAGE_WINDOWS,
    definition_metadata,
    freshness_policy,
    lineage_table,
    lineage_view,
    table_metadata,
)
from assets.checks import CHECK_NAME, build_freshness_checks, build_quality_checks
from assets.config import RecoveryConfig, WindowRunConfig, delivery
from assets.follow import build_follow_job
from assets.maintenance import build_maintenance
from assets.runs import (
    TRANSIENT_RETRY_POLICY,
    at_boundary,
    make_engine,
    open_items_metadata,
    run_windows,
    sink_metadata,
)
from onceflow import Job, ops
from onceflow.ops import ReconcileReport, format_windows
from resources import OnceflowSettingsResource, PostgresResource, SparkResource
from resources._annotations import typed
from sensors import build_failure_sensor, build_new_data_sensor, build_reconcile_schedule
from sensors.failure import JOB_TAG, KIND_TAG
from sensors.observation import source_observation
from sensors.quality import build_quality_sensor
from sensors.schedules import RECONCILE_CRON


class JobDefs(NamedTuple):
    """Everything Dagster needs for one onceflow job."""

    assets: list[Any]
    checks: list[AssetChecksDefinition]
    sensors: list[SensorDefinition]
    jobs: list[JobDefinition]
    schedules: list[ScheduleDefinition]


def source_key(job: Job) -> AssetKey:
    """The observable source asset of a job whose input no onceflow job writes."""
    return AssetKey(f"{job.name}_{job.source.kind}")


def sink_key(sink_name: str) -> AssetKey:
    return AssetKey(sink_name)


def lake_tables(jobs: Sequence[Job]) -> dict[str, AssetKey]:
    """Each lake table some job writes, with the asset of the sink that writes it."""
    return {
        sink.lake_table: sink_key(sink.name)
        for job in jobs
        for sink in job.sinks
        if sink.lake_table is not None
    }


def build_job_assets(
    job: Job,
    upstream: Mapping[str, AssetKey] | None = None,
    *,
    reconcile_cron: str = RECONCILE_CRON,
) -> JobDefs:
    """Build the source, the sink assets, recovery, checks, jobs, sensors and schedule.

    One run of the sink assets is one run of the engine: it commits every sink, so the assets
    cannot be materialised apart (`can_subset=False`). When another job writes the table this
    job reads (`upstream`, from `lake_tables`), that job's sink asset is this job's upstream;
    otherwise the job gets an observable source asset. `reconcile_cron`: when the reconcile
    schedule runs the recovery job (hourly by default).
    """
    table = job.source.lake_table
    parent = (upstream or {}).get(table) if table is not None else None
    source = None if parent is not None else _source_asset(job)
    observed = source_key(job) if source is not None else None
    sinks = _sink_assets(job, parent or source_key(job), observed)
    recovery = _recovery_asset(job, sinks)
    tags = {JOB_TAG: job.name}
    run_job = define_asset_job(
        f"{job.name}_job",
        selection=[spec.key for spec in sinks.specs],
        tags={**tags, KIND_TAG: "run"},
        description=f"Runs {job.name}: new data, or a backfill/restatement of chosen windows.",
        # The engine step and the checks after it run in the run worker: no process to start
        # per step (seconds of imports each), and the checks reuse the step's Spark session.
        # Nothing is lost by sharing a process: a killed run is replayed like any crash.
        executor_def=in_process_executor,
    )
    freshness = build_freshness_checks(job, [spec.key for spec in sinks.specs])
    recovery_job = define_asset_job(
        f"{job.name}_recovery_job",
        # The hourly reconcile runs this job too, so a stale input is seen within the hour.
        selection=AssetSelection.assets(recovery.key)
        | AssetSelection.checks(*[k for c in freshness for k in c.check_keys]),
        tags={**tags, KIND_TAG: "recovery"},
        description=(
            f"Replays {job.name}'s pending windows, commits unplanned input, verifies every sink, "
            "reconciles."
        ),
    )
    follow_job = build_follow_job(
        job,
        [spec.key for spec in sinks.specs],
        pool_name(job),
        jobs=[run_job.name, recovery_job.name],
        assets=[*(spec.key for spec in sinks.specs), recovery.key],
    )
    trigger = follow_job if delivery() == "follow" else run_job
    upkeep = [build_maintenance(job)]
    return JobDefs(
        assets=[a for a in (source, sinks, recovery) if a is not None],
        checks=[
            *build_quality_checks(job, [spec.key for spec in sinks.specs]),
            *freshness,
        ],
        sensors=[
            build_new_data_sensor(
                job,
                trigger,
                tags,
                observe=observed,
                resume=follow_job.name if trigger is follow_job else None,
            ),
            build_failure_sensor(job, recovery_job),
            build_quality_sensor(
                job,
                recovery_job,
                [AssetCheckKey(spec.key, CHECK_NAME) for spec in sinks.specs],
                recovery.op.name,
            ),
        ],
        jobs=[run_job, recovery_job, follow_job, *(j for j, _ in upkeep)],  # type: ignore[list-item]
        schedules=[
            build_reconcile_schedule(job, recovery_job, cron=reconcile_cron),
            *(s for _, s in upkeep),
        ],
    )


def _source_asset(job: Job) -> Any:
    @observable_source_asset(
        key=source_key(job),
        group_name=job.name,
        description=f"Input of {job.name}: {job.source.describe()}.",
    )
    @typed
    def _observe(onceflow: OnceflowSettingsResource) -> ObserveResult:
        seen = job.source.observe(onceflow.settings())
        return ObserveResult(
            data_version=DataVersion(seen.version),
            metadata={"units": MetadataValue.int(seen.units), **dict(seen.metadata)},
        )

    return _observe


def _sink_assets(job: Job, upstream: AssetKey, observed: AssetKey | None) -> AssetsDefinition:
    """The sink assets, materialised by one engine run. `observed`: the job's source asset,
    observed at the start of every run, so the data version each materialisation consumed is
    recorded against the input it could see."""
    specs = [
        AssetSpec(
            key=sink_key(sink.name),
            deps=[upstream],
            group_name=job.name,
            kinds={sink.kind},
            description=f"{sink.describe()}: {job.name} output `{sink.output}`.",
            metadata={
                "onceflow/job": job.name,
                "onceflow/sink": sink.name,
                **definition_metadata(sink),
            },
            freshness_policy=freshness_policy(job),
        )
        for sink in job.sinks
    ]

    def materialize_all(
        context: AssetExecutionContext,
        config: WindowRunConfig,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> list[MaterializeResult]:
        engine = make_engine(job, spark, postgres, onceflow)
        if observed is not None:
            context.log_event(source_observation(job, observed, engine.settings))
        request = context.dagster_run.root_run_id or context.run_id
        report = run_windows(engine, config, context.run_id, request, context.log)
        items = open_items_metadata(engine)
        recent = ops.lineage(engine, limit=LINEAGE_WINDOWS)
        gaps = engine.ledger.abandoned_reasons()
        results = []
        for sink in job.sinks:
            abandoned = {wid: reason for wid, name, reason in gaps if name == sink.name}
            group = engine.group_of[sink.name]
            version = group.data_version(sink.name)
            results.append(
                MaterializeResult(
                    asset_key=sink_key(sink.name),
                    metadata={
                        **sink_metadata(report, sink.name, version),
                        **items,
                        **table_metadata(sink, group.table_facts(sink.name)),
                        "lineage": lineage_table(recent, sink, abandoned),
                        "lineage_view": lineage_view(job.name),
                    },
                    data_version=DataVersion(str(version)) if version is not None else None,
                )
            )
        return results

    @multi_asset(
        name=f"{job.name}_run",
        specs=specs,
        can_subset=False,
        description=job.description or f"One run of the onceflow job {job.name}.",
        op_tags={JOB_TAG: job.name},
        pool=pool_name(job),
        retry_policy=TRANSIENT_RETRY_POLICY,
    )
    @typed
    def _run(
        context: AssetExecutionContext,
        config: WindowRunConfig,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> Iterator[MaterializeResult]:
        # One boundary around the whole step: only errors the core marks transient are retried.
        yield from at_boundary(materialize_all, context)(context, config, spark, postgres, onceflow)

    return _run


def _recovery_asset(job: Job, sinks: AssetsDefinition) -> AssetsDefinition:
    key = AssetKey(f"{job.name}_recovery")

    def recover(
        context: AssetExecutionContext,
        config: RecoveryConfig,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> MaterializeResult:
        engine = make_engine(job, spark, postgres, onceflow)
        # `onceflow.ops.recover`: lost windows put back, pending windows and unplanned input
        # committed, the last windows verified, then reconcile.
        recovered = ops.recover(
            engine,
            run_id=context.run_id,
            verify_last=config.verify_last,
            reconcile=config.reconcile,
            dry_run=config.dry_run,
        )
        for sink, ids in recovered.restored.items():
            context.log.warning(
                f"{sink} had lost committed windows {format_windows(ids)}; replayed"
            )
        replayed = recovered.replayed
        for window in replayed:
            context.log.info(
                f"window {window.window_id}: "
                + ("already committed in every sink" if window.noop else "replayed")
            )
        incomplete = recovered.incomplete
        metadata: dict[str, Any] = {
            "windows_replayed": MetadataValue.int(sum(1 for w in replayed if not w.noop)),
            "windows_verified": MetadataValue.int(len(recovered.verified)),
            "windows_incomplete": MetadataValue.int(len(incomplete)),
            "replayed": MetadataValue.text(
                format_windows([w.window_id for w in replayed if not w.noop]) or "none"
            ),
            "windows_restored": MetadataValue.json(recovered.restored),
            **open_items_metadata(engine),
        }
        metadata.update(_reconcile_metadata(recovered.reconcile, config))
        return MaterializeResult(
            metadata=metadata,
            check_results=[
                AssetCheckResult(
                    check_name="all_windows_committed",
                    passed=not incomplete,
                    severity=AssetCheckSeverity.ERROR,
                    metadata={
                        "windows_incomplete": MetadataValue.int(len(incomplete)),
                        "incomplete": MetadataValue.json(
                            {str(w): s for w, s in list(incomplete.items())[:50]}
                        ),
                    },
                )
            ],
        )

    @asset(
        key=key,
        deps=[spec.key for spec in sinks.specs],
        group_name=job.name,
        kinds={"spark"},
        description=(
            f"Recovery of {job.name}: replays pending windows, commits input no window has "
            "planned yet, verifies that every sink holds every window, and reconciles the sinks "
            "with what they should hold."
        ),
        check_specs=[AssetCheckSpec("all_windows_committed", asset=key)],
        op_tags={JOB_TAG: job.name},
        pool=pool_name(job),
        retry_policy=TRANSIENT_RETRY_POLICY,
    )
    @typed
    def _recover(
        context: AssetExecutionContext,
        config: RecoveryConfig,
        spark: SparkResource,
        postgres: PostgresResource,
        onceflow: OnceflowSettingsResource,
    ) -> MaterializeResult:
        return at_boundary(recover, context)(context, config, spark, postgres, onceflow)

    return _recover


def _reconcile_metadata(report: ReconcileReport | None, config: RecoveryConfig) -> dict[str, Any]:
    if report is None:
        return {"reconcile": MetadataValue.text("off")}
    metadata: dict[str, Any] = {
        "reconcile": MetadataValue.text(
            config.reconcile + (" (dry run)" if config.dry_run else "")
        ),
        "reconcile_clean": MetadataValue.bool(bool(report.clean)),
        "reconcile_wall_s": MetadataValue.float(round(float(report.wall_s), 3)),
        "unverifiable": MetadataValue.int(len(report.unverifiable)),
        "windows_reconciled": MetadataValue.int(len(report.windows_checked)),
        # An incremental reconcile recomputes only the windows after this one (0: all).
        "windows_recomputed": MetadataValue.int(report.windows_recomputed),
        "recomputed_after_window": MetadataValue.int(report.recomputed_after),
    }
    for diff in report.sinks:
        metadata[f"{diff.sink}.missing"] = MetadataValue.int(diff.missing)
        metadata[f"{diff.sink}.extra"] = MetadataValue.int(diff.extra)
        metadata[f"{diff.sink}.changed"] = MetadataValue.int(diff.changed)
        metadata[f"{diff.sink}.repaired"] = MetadataValue.bool(diff.repaired)
        if diff.samples:  # keys only (a keyless sink: windows), never other columns' values
            metadata[f"{diff.sink}.first_differences"] = MetadataValue.md(
                "\n".join(
                    f"- {kind}: {'; '.join(items)}" for kind, items in diff.explained().items()
                )
            )
    return metadata


def pool_name(job: Job) -> str:
    """The concurrency pool of a job's ops: one at a time however the run was launched (the
    UI's asset graph launches runs without the job's tags)."""
    return f"onceflow_{job.name}"
