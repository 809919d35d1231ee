"""A job's quality suites, derived from its sink definitions, and how to run them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from onceflow._identifiers import delta_app_id
from onceflow.job import DeltaSink, PostgresSink

if TYPE_CHECKING:
    from onceflow.engine import Engine
    from onceflow.quality import Target, ValidationReport


def quality_targets(engine: Engine) -> list[Target]:
    """One target per sink, plus the sum checks the job declares in `metadata["sums"]`.

    Keys come from the sink (PostgreSQL) or the job's dedupe key (Delta); value rules from
    `metadata["regex"]` (column → pattern), applied to every sink that has the column.
    """
    from onceflow.quality import DeltaTableTarget, PostgresTableTarget, SumConsistency

    job = engine.job
    regex: dict[str, str] = dict(job.metadata.get("regex", {}))
    dedupe_key = job.dedupe.key if job.dedupe else ()
    targets: list[Target] = []
    for sink in job.sinks:
        if isinstance(sink, DeltaSink):
            if not dedupe_key:
                continue
            targets.append(
                DeltaTableTarget(
                    sink=sink.name,
                    path=str(engine.settings.lake / sink.table),
                    key=dedupe_key,
                    expected_output=sink.output,
                    app_id=delta_app_id(job.name, sink.name),
                    not_null=dedupe_key,
                    regex=regex,
                )
            )
        elif isinstance(sink, PostgresSink) and sink.key:
            targets.append(
                PostgresTableTarget(
                    sink=sink.name,
                    schema=sink.schema,
                    table=sink.table,
                    key=sink.key,
                    expected_rows_from="none" if sink.mode == "accumulate" else "markers",
                    not_null=sink.key,
                    regex={c: p for c, p in regex.items() if c in sink.columns},
                    row_filter={"job": job.name} if "job" in sink.columns else {},
                )
            )
    for sink_name, rule in dict(job.metadata.get("sums", {})).items():
        balances = job.sink(sink_name)
        source = job.sink(rule["source_sink"])
        assert isinstance(balances, PostgresSink) and isinstance(source, PostgresSink)
        targets.append(
            SumConsistency(
                sink=sink_name,
                balances=(balances.schema, balances.table),
                group_keys=balances.key,
                total_col=rule["total"],
                count_col=rule["count"],
                source=(source.schema, source.table),
                amount_col=rule["amount"],
            )
        )
    return targets


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
