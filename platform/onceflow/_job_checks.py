"""A job's declarations checked against each other, as early as each can be.

When the job loads (its `Job(...)` is built, before Spark starts): the sinks against the
declared outputs, the quarantine sink against the quarantine output, the dedupe key and the
sinks' untyped columns against the source's schema. At each window's plan (`check_outputs`),
against the schema of what the transform gave (`DataFrame.columns`: analysis, no Spark job),
before anything is computed or written: every output a sink takes, every column a sink
declares. A mistake found either way is a `ConfigurationError` naming the job, the sink and
the column: running again cannot help, fixing the job does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError
from onceflow.sinks.base import SinkSpec
from onceflow.sinks.postgres.spec import QUARANTINE_COLUMNS
from onceflow.sources._typed import Schema
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.job import Job


def source_schema(job: Job) -> Schema | None:
    """The columns the job's source declares (typed landing sources), if any."""
    schema = getattr(job.source, "schema", None)
    return schema if isinstance(schema, Schema) else None


def typed_sinks(job: Job) -> tuple[SinkSpec, ...]:
    """The job's sinks with every column declared without a type typed as the source's column
    of that name.

    Raises:
        ConfigurationError: Such a column is not a column of the source.
    """
    schema = source_schema(job)
    sinks: list[SinkSpec] = []
    for sink in job.sinks:
        if sink.untyped_columns:
            unknown = [c for c in sink.untyped_columns if schema is None or c not in schema]
            if unknown:
                has = (
                    f"the source declares {list(schema)}"
                    if schema is not None
                    else f"the source ({job.source.describe()}) declares no columns"
                )
                raise ConfigurationError(
                    f"job {job.name}: sink {sink.name}: column {unknown[0]} is given without a "
                    f"type, so it takes the source column's, but {has}. Give its type: "
                    f"columns={{..., {unknown[0]!r}: 'bigint'}} (or the type it has)."
                )
            assert schema is not None
            sink = sink.typed(schema)
        sinks.append(sink)
    return tuple(sinks)


def check_job(job: Job) -> None:
    """Every mismatch between the job's declarations that needs no data to see.

    Raises:
        ConfigurationError: Naming the job, the sink and the column or output, and the fix.
    """
    _check_quarantine(job)
    _check_outputs_declared(job)
    schema = source_schema(job)
    if job.dedupe is not None and job.parse is None and schema is not None:
        for column in job.dedupe.key:
            if column not in schema:
                raise ConfigurationError(
                    f"job {job.name}: dedupe key column {column} is not a column of the source "
                    f"(it declares {list(schema)}); name one of those in Dedupe(key=...)."
                )


def _check_quarantine(job: Job) -> None:
    for sink in job.sinks:
        if sink.is_quarantine_table and sink.name != job.quarantine_sink:
            fix = (
                f"add quarantine_sink={sink.name!r} to the Job"
                if job.quarantine_sink is None
                else f"a job has one quarantine sink ({job.quarantine_sink}): remove {sink.name}"
            )
            raise ConfigurationError(
                f"job {job.name}: sink {sink.name} is a quarantine table (quarantine_table()), "
                "but the job does not name it as its quarantine_sink, so nothing would give "
                f"it the invalid records (its output {sink.output!r}); {fix}."
            )
    if job.quarantine_sink is None:
        return
    sink = job.sink(job.quarantine_sink)
    extra = [c for c, _ in sink.declared_columns() if c not in QUARANTINE_COLUMNS]
    if extra:
        raise ConfigurationError(
            f"job {job.name}: sink {sink.name} is the job's quarantine_sink, which receives "
            f"the invalid records with the columns {list(QUARANTINE_COLUMNS)}; it declares "
            f"column {extra[0]}, which they do not have. Use quarantine_table({sink.name!r}), "
            "or declare only those columns."
        )


def _check_outputs_declared(job: Job) -> None:
    if not job.outputs:
        return
    declared = list(job.outputs)
    if len(set(declared)) != len(declared):
        raise ConfigurationError(f"job {job.name}: outputs {declared} name one output twice.")
    quarantine = job.sink(job.quarantine_sink).output if job.quarantine_sink else None
    for sink in job.sinks:
        if sink.name != job.quarantine_sink and sink.output not in declared:
            raise ConfigurationError(
                f"job {job.name}: sink {sink.name} takes output {sink.output!r}, which the "
                f"transform does not declare (outputs={declared}); correct the sink's output, "
                "or add it to outputs and to what the transform returns."
            )
    taken = {s.output for s in job.sinks}
    for output in declared:
        if output not in taken and output != quarantine:
            raise ConfigurationError(
                f"job {job.name}: output {output!r} goes to no sink; give it a sink, or take "
                "it out of outputs and of what the transform returns."
            )


def check_outputs(job: Job, outputs: Mapping[str, DataFrame]) -> None:
    """The transform's outputs of a window (and the quarantine output) against the sinks:
    each output a sink takes is there, and has every column the sink declares. Reads the
    frames' schemas only (no Spark job).

    Raises:
        ConfigurationError: Naming the job, the sink, the output and the column.
    """
    quarantine = job.sink(job.quarantine_sink).output if job.quarantine_sink else None
    given = sorted(outputs)
    for sink in job.sinks:
        if sink.output not in outputs:
            raise ConfigurationError(
                f"job {job.name}: sink {sink.name} takes output {sink.output!r}, but the "
                f"transform gave no output named {[sink.output]}; it gave {given}. Every "
                "sink's `output` must be one of them; nothing was written."
            )
    if job.outputs:
        other = [n for n in given if n not in job.outputs and n != quarantine]
        if other:
            raise ConfigurationError(
                f"job {job.name}: the transform gave output {other[0]!r}, which the job does "
                f"not declare (outputs={list(job.outputs)}); nothing was written."
            )
    for sink in job.sinks:
        columns = outputs[sink.output].columns
        for column, why in _needed(job, sink):
            if column not in columns:
                has = [c for c in columns if c != WINDOW_COL]
                fix = "add it to that output"
                if why == "declares":
                    fix += ", or take it out of the sink's columns"
                raise ConfigurationError(
                    f"job {job.name}: sink {sink.name} {why} column {column}, but the "
                    f"transform's output {sink.output!r} has no column {column} (it has {has}); "
                    f"{fix}. Nothing was written."
                )


def _needed(job: Job, sink: SinkSpec) -> Sequence[tuple[str, str]]:
    """The columns `sink` needs in its output, each with why: those it declares, and for the
    dedupe state sink the dedupe key and `_window_id`."""
    needed = [(c, "declares") for c, _ in sink.declared_columns()]
    dedupe = job.dedupe
    if dedupe is not None and sink.holds_dedupe_state and sink.name == dedupe.state_sink:
        why = "holds the dedupe state, which needs"
        needed += [(c, why) for c in (*dedupe.key, "_window_id")]
    return needed
