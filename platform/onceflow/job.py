"""Job definitions: a source, an optional parse step, a transform, sinks and a guarantee."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from onceflow._identifiers import check_identifier
from onceflow.errors import ConfigurationError
from onceflow.sinks.spec import SinkSpec
from onceflow.sources._typed import Schema
from onceflow.sources.base import Source
from onceflow.windows import WINDOW_COL

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame


class Guarantee(str, enum.Enum):
    """What a job promises about each record's effect on its sinks."""

    EXACTLY_ONCE = "exactly_once"  # markers, app transactions, epoch fences, replay
    AT_LEAST_ONCE = "at_least_once"  # replay after a crash, but no commit records: may double
    NONE = "none"  # no write-ahead plan: a crash may lose or double a window


@dataclass(frozen=True)
class WindowContext:
    """What a transform may know about the window it runs on."""

    job: str
    window_id: int

    def window_id_column(self) -> Column:
        """The window's id as a BIGINT column expression, usable wherever a column is.

        Prefer it to `F.lit(ctx.window_id)`: a literal is a new constant in every window's
        plan, so Spark generates and compiles that plan's code again for each window (and the
        JVM compiles it again), where the column gives every window the same code. It reads
        the id from a column the transform's rows carry; used where they no longer do (after
        a `select` or an aggregate that left it out), the transform is called again and it is
        the window's id as a constant there (that job's windows are then planned one by one).
        """
        from pyspark.sql import functions as F

        return F.col(WINDOW_COL)


@dataclass(frozen=True)
class Dedupe:
    """Keep the first occurrence of each key in source order, across all windows.

    Keys seen in earlier windows are read from `state_sink` (a sink whose kind can hold dedupe
    state, such as a Delta sink keeping every kept row with its window id), restricted to
    windows before the current one, so a window replayed after a partial commit is deduplicated
    exactly as the first time. A record whose key has a null part has no key: it is quarantined
    (reason `dedupe key column <c> is null`), every one, never kept or dropped as a duplicate.
    """

    key: tuple[str, ...]
    state_sink: str


ParseFn = Callable[["DataFrame"], "DataFrame"]
TransformFn = Callable[["DataFrame", WindowContext], Mapping[str, "DataFrame"]]

QUARANTINE_OUTPUT = "quarantine"
# The columns of a quarantined record, whatever sink keeps them (`quarantine_table()`).
QUARANTINE_FIELDS = ("job", "window_id", "source_file", "source_line", "raw_line", "reason")


@dataclass(frozen=True)
class Job:
    """A job: what to read, how to parse and transform it, and where its results go.

    Attributes:
        name: The job's name (an identifier; it keys the ledger, markers and app ids).
        source: Where the input comes from (`onceflow.sources`).
        transform: Valid (deduplicated) records → named outputs; pure, no side effects. It
            may be called again for the same window (a replay, a reconcile) and must then give
            the same rows; the engine stages each window's outputs once so every sink and every
            retry sees the same rows even when it does not.
        sinks: Where each output goes; every sink commits each window exactly once.
        parse: Raw records → typed columns plus `_reason` (null for valid records) and
            `_raw_text`. Needed for raw sources (JSON lines); typed sources validate records
            themselves and need none, but may have one (it gets the typed frame, and sets
            `_reason` on the records it rejects; those keep their text for the quarantine).
        dedupe: Optional first-occurrence deduplication across windows.
        quarantine_sink: Name of the sink receiving invalid records (`quarantine` output).
        guarantee: The delivery guarantee.
        description: Shown in the UI.
        metadata: Extra rules for the quality suites (`regex`, `sums`); see docs/jobs.md.
        freshness_s: Input visible for longer than this without a window planning it fails the
            job's freshness check (a trigger that never fired, runs that died before planning).
        deterministic: The parse and transform are pure functions of their input (no `rand()`,
            `uuid()`, `current_timestamp()`, nothing read from outside): a window's outputs are
            then computed again from its input on a replay instead of being staged first, which
            saves a write and a read of every output. Leave it False when in doubt: a replay
            of a non-deterministic transform would give some sinks other rows than the rest.
            A deterministic job whose `parse` is an order-keeping `ArrowParse` over landing
            files is also planned once for the windows of a run, not once per window, if its
            transform reads nothing but its rows (no `ctx.window_id` while planning; use
            `ctx.window_id_column()`) — each window's tasks are given that window's files and
            id when they run.
        outputs: The names of the outputs the transform returns (optional). Declared, every
            sink's output is checked against them when the job loads, and what the transform
            gives at each window's plan; undeclared, only the latter.

    Every mismatch between these declarations (sinks, outputs, columns, keys, quarantine) is a
    ConfigurationError when the job loads, or at its first window's plan where only the
    transform's output schema tells (`check_outputs` below), never a failed write.
    """

    name: str
    source: Source
    transform: TransformFn
    sinks: tuple[SinkSpec, ...]
    parse: ParseFn | None = None
    dedupe: Dedupe | None = None
    quarantine_sink: str | None = None
    guarantee: Guarantee = Guarantee.EXACTLY_ONCE
    description: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    freshness_s: float = 3600.0
    deterministic: bool = False
    outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_identifier(self.name, "job name")
        if not self.freshness_s > 0:
            raise ConfigurationError(
                f"job {self.name}: freshness_s must be a positive number of seconds, got "
                f"{self.freshness_s!r}."
            )
        if not isinstance(self.source, Source):
            raise ConfigurationError(
                f"job {self.name}: source must be an onceflow Source (LandingSource, CsvSource, "
                f"ParquetSource, DeltaTableSource, …), got {type(self.source).__name__}."
            )
        object.__setattr__(self, "sinks", tuple(self.sinks))
        object.__setattr__(self, "guarantee", Guarantee(self.guarantee))
        if not self.sinks:
            raise ConfigurationError(f"job {self.name}: give it at least one sink.")
        for sink in self.sinks:
            if not isinstance(sink, SinkSpec):
                raise ConfigurationError(
                    f"job {self.name}: sinks must be DeltaSink or PostgresSink specs, got "
                    f"{type(sink).__name__}."
                )
        names = [s.name for s in self.sinks]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"job {self.name}: sink names must be unique, got {names}.")
        if self.parse is None and not self.source.typed:
            raise ConfigurationError(
                f"job {self.name}: its source ({self.source.describe()}) gives raw records; "
                "give the job a `parse` function that turns them into typed columns with "
                "`_reason` and `_raw_text`."
            )
        if self.parse is not None and getattr(self.source, "raw_text", None) is False:
            # A parse on a typed source may reject records the source found valid: they keep
            # their text for the quarantine only if the source keeps every record's.
            object.__setattr__(self, "source", replace(self.source, raw_text=True))  # type: ignore[call-arg]
        if self.dedupe is not None:
            state = self.sink(self.dedupe.state_sink)
            if not state.holds_dedupe_state:
                raise ConfigurationError(
                    f"job {self.name}: dedupe state sink {state.name} is a {state.kind} sink, "
                    "which cannot hold dedupe state; use a Delta sink."
                )
            if not self.dedupe.key:
                raise ConfigurationError(f"job {self.name}: dedupe needs at least one key column.")
        if self.quarantine_sink is not None:
            self.sink(self.quarantine_sink)
        if isinstance(self.outputs, str):
            object.__setattr__(self, "outputs", (self.outputs,))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        for output in self.outputs:
            check_identifier(output, f"job {self.name}: output")
        object.__setattr__(self, "sinks", typed_sinks(self))
        check_job(self)

    def sink(self, name: str) -> SinkSpec:
        """The sink named `name`.

        Raises:
            ConfigurationError: The job has no such sink.
        """
        for sink in self.sinks:
            if sink.name == name:
                return sink
        raise ConfigurationError(
            f"job {self.name}: no sink named {name!r}; sinks are {[s.name for s in self.sinks]}."
        )

    def with_guarantee(self, guarantee: Guarantee | str) -> Job:
        """This job with another guarantee (to compare what exactly-once costs)."""
        return replace(self, guarantee=Guarantee(guarantee))


# A job's declarations checked against each other, as early as each can be.
#
# A job's declarations checked against each other, as early as each can be.
#
# When the job loads (its `Job(...)` is built, before Spark starts): the sinks against the
# declared outputs, the quarantine sink against the quarantine output, the dedupe key and the
# sinks' untyped columns against the source's schema. At each window's plan (`check_outputs`),
# against the schema of what the transform gave (`DataFrame.columns`: analysis, no Spark job),
# before anything is computed or written: every output a sink takes, every column a sink
# declares. A mistake found either way is a `ConfigurationError` naming the job, the sink and
# the column: running again cannot help, fixing the job does.


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
    extra = [c for c, _ in sink.declared_columns() if c not in QUARANTINE_FIELDS]
    if extra:
        raise ConfigurationError(
            f"job {job.name}: sink {sink.name} is the job's quarantine_sink, which receives "
            f"the invalid records with the columns {list(QUARANTINE_FIELDS)}; it declares "
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
