"""reconcile(): expected state from the ledger's windows, diffed with every sink and repaired."""

from __future__ import annotations

import logging
import re
import shutil
import time
import uuid
from datetime import datetime, timedelta, timezone
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from onceflow.engine import Engine
from onceflow.errors import ConfigurationError
from onceflow.job import DeltaSink, PostgresSink
from onceflow.ledger import Window
from onceflow.sinks.delta import read_delta

from ._delta import reconcile_delta
from ._diff import Diff
from ._expected import WINDOW_COL, expected_outputs
from ._postgres import reconcile_postgres, spark_schema
from ._report import ReconcileReport, SinkDiff

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

_log = logging.getLogger(__name__)

RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"
_UNITS = {
    "nanosecond": timedelta(microseconds=0.001),
    "microsecond": timedelta(microseconds=1),
    "millisecond": timedelta(milliseconds=1),
    "second": timedelta(seconds=1),
    "minute": timedelta(minutes=1),
    "hour": timedelta(hours=1),
    "day": timedelta(days=1),
    "week": timedelta(weeks=1),
}
_INTERVAL_PART = re.compile(r"(\d+)\s*([a-z]+?)s?\b")


def parse_interval(text: str) -> timedelta:
    """A Delta interval property (`interval 7 days`, `2 weeks 3 days`) as a timedelta.

    Raises:
        ConfigurationError: When the text is not an interval of known units.
    """
    body = text.strip().lower()
    body = body.removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(body)
    if not parts or _INTERVAL_PART.sub("", body).strip():
        raise ConfigurationError(f"{RETENTION_PROPERTY} = {text!r} is not a Delta interval.")
    total = timedelta()
    for number, unit in parts:
        if unit not in _UNITS:
            raise ConfigurationError(f"{RETENTION_PROPERTY} = {text!r}: unknown unit {unit!r}.")
        total += int(number) * _UNITS[unit]
    return total


def check_replay_horizon(engine: Engine) -> None:
    """Refuse when a Delta sink may forget its window records before the oldest window.

    A Delta table drops application transactions older than its
    `delta.setTransactionRetentionDuration` when it checkpoints; a sink that forgot them looks
    as if it held no window, and a replay would write committed windows again.

    Raises:
        ConfigurationError: When a Delta sink's retention is shorter than the age of the job's
            oldest window (from the ledger or the table's own commits).
    """
    tables = [(s, s.table()) for s in engine.delta.values() if s.exists()]
    settings = [
        (sink, value)
        for sink, table in tables
        if (value := table.metadata().configuration.get(RETENTION_PROPERTY)) is not None
    ]
    if not settings:
        return
    oldest: datetime | None = None
    with engine.ledger.connect() as conn:
        row = conn.execute(
            "SELECT min(planned_at) FROM onceflow.windows WHERE job = %s", (engine.job.name,)
        ).fetchone()
        if row and row[0] is not None:
            oldest = row[0]
    for sink, _ in settings:
        for entry in sink.history():
            committed = datetime.fromtimestamp(int(entry["timestamp"]) / 1000, timezone.utc)
            oldest = committed if oldest is None else min(oldest, committed)
            break  # history() is in window order: the first entry is the oldest window
    if oldest is None:
        return
    horizon = datetime.now(timezone.utc) - oldest
    for sink, value in settings:
        retention = parse_interval(value)
        if retention < horizon:
            raise ConfigurationError(
                f"Delta table {sink.path} sets {RETENTION_PROPERTY} = {value!r}, shorter than "
                f"the job's replay horizon ({horizon.days} day(s), the age of its oldest window):"
                " the table may forget which windows it holds, and a replay would write them "
                f"again. Remove the property or set it longer than the horizon "
                "(DeltaTable(...).alter.set_table_properties)."
            )


def _verified_through(engine: Engine) -> dict[str, int]:
    with engine.ledger.connect() as conn:
        rows = conn.execute(
            "SELECT sink, verified_through FROM onceflow.reconciliations WHERE job = %s",
            (engine.job.name,),
        ).fetchall()
    return {str(s): int(v) for s, v in rows}


def _record_verified(engine: Engine, verified: dict[str, int]) -> None:
    with engine.ledger.connect() as conn:
        for sink, through in verified.items():
            conn.execute(
                "INSERT INTO onceflow.reconciliations (job, sink, verified_through)"
                " VALUES (%s, %s, %s) ON CONFLICT (job, sink) DO UPDATE"
                " SET verified_through = EXCLUDED.verified_through, verified_at = now()",
                (engine.job.name, sink, through),
            )
        conn.commit()


def _outside(column: Column, skip: set[int], since: int) -> Column:
    """Rows to compare: not in a skipped window, after `since`; rows without a window too."""

    keep = column > since
    if skip:
        keep = keep & ~column.isin(sorted(skip))
    return column.isNull() | keep


def reconcile(
    engine: Engine,
    *,
    dry_run: bool = False,
    mode: Literal["full", "incremental"] = "full",
) -> ReconcileReport:
    """Diff every sink of the engine's job with its expected state and repair the difference.

    The expected state is replayed from the ledger's windows (every window whose input is
    still there, in window order, deduplicated over the whole sequence), restricted per sink
    to the windows the sink has committed. Windows whose input is gone or changed are
    reported as unverifiable and their rows are left alone; a sink with no per-row window
    (an accumulate sink) is then not checked at all. A repair takes a new epoch, so it fences
    any run of the job, and is atomic per sink.

    Incremental mode compares only rows of windows after each sink's last verified window
    (`onceflow.reconciliations`); accumulate sinks have no per-window rows and are always
    compared in full, so the replay always covers every window.

    Args:
        engine: The engine of the job to reconcile.
        dry_run: Only report; write nothing (no epoch is taken).
        mode: `full` or `incremental`.

    Returns:
        The report: windows checked, unverifiable windows, per-sink counts.

    Raises:
        ConfigurationError: On an unknown mode, or a Delta transaction retention shorter
            than the replay horizon.
        FencedError: When a newer run took over during the repair.
    """
    from pyspark.sql import functions as F

    started = time.monotonic()
    if mode not in ("full", "incremental"):
        raise ConfigurationError(f"reconcile mode {mode!r} is unknown; use full or incremental.")
    job, spark, settings = engine.job, engine.spark, engine.settings
    engine.prepare()
    engine.rebuild_ledger()
    check_replay_horizon(engine)
    run_id = f"reconcile-{uuid.uuid4().hex}"
    epoch: int | None = None
    if not dry_run:
        epoch = engine.ledger.acquire_epoch(run_id, floor=engine.sink_epoch_floor())
        for delta_sink in engine.delta.values():
            if delta_sink.exists():
                delta_sink.claim_epoch(epoch)
    windows = engine.ledger.windows()
    unverifiable: list[tuple[int, str]] = []
    available: list[Window] = []
    for window in windows:
        problems = job.source.check_available(settings.landing, window.offsets)
        if problems:
            unverifiable.append((window.window_id, "; ".join(problems[:3])))
        else:
            available.append(window)
    bad = {wid for wid, _ in unverifiable}
    verified = _verified_through(engine) if mode == "incremental" else {}
    workdir = settings.lake / "_onceflow" / "reconcile" / job.name / uuid.uuid4().hex
    try:
        seen = None
        if job.dedupe is not None and bad:
            # The first occurrences in windows that cannot be replayed are known only from the
            # state sink; trusting it here is the best there is (the input is gone).
            state = engine.delta[job.dedupe.state_sink]
            if state.exists():
                seen = (
                    read_delta(spark, state.path)
                    .where(F.col("_window_id").isin(sorted(bad)))
                    .select(*job.dedupe.key, F.col("_window_id").alias(WINDOW_COL))
                )
        outputs = expected_outputs(spark, job, settings.landing, available, workdir, seen=seen)
        diffs: list[SinkDiff] = []
        checked: set[int] = set()
        newly_verified: dict[str, int] = {}
        for sink in job.sinks:
            diff, committed, compared = _reconcile_sink(
                engine, sink, outputs.get(sink.output), bad, verified, epoch, run_id, workdir
            )
            if isinstance(diff, str):
                diffs.append(SinkDiff(sink.name, 0, 0, 0, False, skipped=diff))
                continue
            diffs.append(
                SinkDiff(sink.name, diff.missing, diff.extra, diff.changed,
                         repaired=epoch is not None and not diff.empty)
            )  # fmt: skip
            checked |= compared
            first_bad = min(bad) if bad else None
            through = max((w for w in committed if first_bad is None or w < first_bad), default=0)
            newly_verified[sink.name] = through
        if epoch is not None:
            _record_verified(engine, newly_verified)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return ReconcileReport(
        job=job.name,
        mode=mode,
        dry_run=dry_run,
        windows_checked=sorted(checked),
        unverifiable=unverifiable,
        sinks=diffs,
        wall_s=time.monotonic() - started,
    )


def _reconcile_sink(
    engine: Engine,
    sink: DeltaSink | PostgresSink,
    expected: DataFrame | None,
    bad: set[int],
    verified: dict[str, int],
    epoch: int | None,
    run_id: str,
    workdir: Path,
) -> tuple[Diff | str, set[int], set[int]]:
    """Diff (and repair) one sink.

    Returns the diff (or why the sink was skipped), the windows the sink has committed, and
    the windows whose rows were compared one by one (none for a sink without a window column,
    such as an accumulate sink, whose rows mix windows).
    """
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import _parse_datatype_string

    job, spark = engine.job, engine.spark
    quarantine = sink.name == job.quarantine_sink
    accumulate = isinstance(sink, PostgresSink) and sink.mode == "accumulate"
    since = 0 if accumulate else verified.get(sink.name, 0)
    if isinstance(sink, DeltaSink):
        delta = engine.delta[sink.name]
        if not delta.exists():
            return "the Delta table does not exist yet", set(), set()
        table = delta.table()
        through = table.transaction_version(delta.app_id) or 0
        committed = {w.window_id for w in engine.ledger.windows() if w.window_id <= through}
        schema = from_arrow_schema(pa.schema(table.schema().to_arrow()))
    else:
        pg = engine.postgres[sink.name]
        committed = set(pg.committed_windows())
        schema = _parse_datatype_string(spark_schema(dict(sink.columns)))
    columns = [f.name for f in schema.fields]
    if isinstance(sink, PostgresSink):
        window_col = sink.window_column
    else:
        window_col = "_window_id" if "_window_id" in columns else None
    if window_col is None and bad:
        return "holds rows of unverifiable windows", committed, set()
    if window_col is None:
        since = 0
    compare = {w for w in committed if w > since and w not in bad}
    if expected is None:
        expected = spark.createDataFrame([], schema).withColumn(
            WINDOW_COL, F.lit(None).cast("bigint")
        )
    expected = expected.where(F.col(WINDOW_COL).isin(sorted(compare)) if compare else F.lit(False))
    if accumulate:
        assert isinstance(sink, PostgresSink)
        others = [c for c in columns if c not in sink.key and c not in sink.accumulate]
        expected = expected.groupBy(*sink.key).agg(
            *[F.sum(F.col(c).cast("decimal(38,0)")).alias(c) for c in sink.accumulate],
            *[F.max_by(F.col(c), F.col(WINDOW_COL)).alias(c) for c in others],
        )
        # The sink deletes a row whose accumulated columns all come back to zero.
        expected = expected.where(
            reduce(lambda a, b: a | b, [F.col(c) != 0 for c in sink.accumulate])
        )
    expected = expected.select(*[F.col(f.name).cast(f.dataType) for f in schema.fields])

    def prepare_actual(actual: DataFrame) -> DataFrame:
        if window_col is None:
            return actual
        return actual.where(_outside(F.col(window_col), bad, since))

    if isinstance(sink, DeltaSink):
        diff = reconcile_delta(
            spark, engine.delta[sink.name], table, expected, prepare_actual=prepare_actual,
            workdir=workdir, epoch=epoch, run_id=run_id,
        )  # fmt: skip
    else:
        diff = reconcile_postgres(
            spark, engine.dsn, engine.ledger, engine.postgres[sink.name], expected,
            prepare_actual=prepare_actual, key=sink.key, workdir=workdir, epoch=epoch,
            job_filter=job.name if quarantine else None,
        )  # fmt: skip
    return diff, committed, compare if window_col is not None else set()
