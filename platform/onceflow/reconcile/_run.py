"""reconcile(): expected state from the ledger's windows, diffed with every sink and repaired."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from onceflow._compute import Computed, compute
from onceflow.errors import ConfigurationError, LedgerError, SinkStateError
from onceflow.ledger import Window
from onceflow.sinks.base import ReconcileScope

from ._report import ReconcileReport, SinkDiff

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.engine import Engine

_log = logging.getLogger(__name__)


def _verified_through(engine: Engine) -> dict[str, int]:
    rows = engine.ledger.read(
        "read how far reconcile verified",
        lambda conn: conn.execute(
            "SELECT sink, verified_through FROM onceflow.reconciliations WHERE job = %s",
            (engine.job.name,),
        ).fetchall(),
    )
    return {str(s): int(v) for s, v in rows}


def _record_verified(engine: Engine, verified: dict[str, int]) -> None:
    def record(conn: Any) -> None:  # set-to-a-value: safe to do again after a lost answer
        for sink, through in verified.items():
            conn.execute(
                "INSERT INTO onceflow.reconciliations (job, sink, verified_through)"
                " VALUES (%s, %s, %s) ON CONFLICT (job, sink) DO UPDATE"
                " SET verified_through = EXCLUDED.verified_through, verified_at = now()",
                (engine.job.name, sink, through),
            )

    engine.ledger.write("record how far reconcile verified", record)


def reconcile(
    engine: Engine,
    *,
    dry_run: bool = False,
    mode: Literal["full", "incremental"] = "full",
    on_step: Callable[[str], None] | None = None,
) -> ReconcileReport:
    """Diff every sink of the engine's job with its expected state and repair the difference.

    The expected state is replayed from the ledger's windows (every window whose input is
    still there, in window order, deduplicated over the whole sequence) on the job's one
    compute path, restricted per sink to the windows the sink has committed. Windows whose
    input is gone or changed are reported as unverifiable and their rows are left alone; a
    sink whose rows carry no window id (an accumulating sink) is then not checked at all. A
    repair takes a new epoch, so it fences any run of the job, and is atomic per sink.

    Incremental mode compares only what changed since each sink was last verified
    (`onceflow.reconciliations`), where the sink can (`SinkGroup.reconcile_since`): rows that
    carry their window, of the windows after it; an accumulating table whole, against the
    state it was left in then plus the windows after it. Only the windows after the lowest of
    those points are recomputed, deduplicated against the key index for the windows before.
    A sink that cannot (no per-window rows, an upsert ordered by a column, a state changed
    since by a restatement or a replay) is compared in full, and every window is recomputed.

    Args:
        engine: The engine of the job to reconcile.
        dry_run: Only report; write nothing (no epoch is taken).
        mode: `full` or `incremental`.
        on_step: Told what reconcile does next (a progress display's phase).

    Raises:
        ConfigurationError: On an unknown mode, or a sink whose retention is shorter than the
            replay horizon.
        FencedError: When a newer run took over during the repair.
    """
    started = time.monotonic()
    step = on_step or (lambda text: None)
    if mode not in ("full", "incremental"):
        raise ConfigurationError(f"reconcile mode {mode!r} is unknown; use full or incremental.")
    job, spark, settings = engine.job, engine.spark, engine.settings
    run_id = f"reconcile-{uuid.uuid4().hex}"
    epoch: int | None = None
    replayed: dict[str, list[int]] = {}
    if dry_run:
        engine.prepare()
        engine.rebuild_ledger()
        engine.check_retention()
        lacking = engine.lacking_windows()
        gone = _gone(engine, lacking)
    else:
        epoch = engine.start(run_id)
        # A sink that lost committed windows gets them back first, through the commit protocol,
        # so its commit records are whole again and the diff below sees every window.
        step("replaying windows a sink lacks")
        replay = engine.replay_lacking(epoch, run_id)
        replayed, lacking, gone = replay.restored, replay.left, replay.gone
    abandoned = engine.ledger.abandoned_reasons()
    # Incremental: each sink compares from its verified point, where it can (`since`), and only
    # the windows after the lowest of them are read and recomputed.
    verified = _verified_through(engine) if mode == "incremental" else {}
    since = {
        s.name: engine.group_of[s.name].reconcile_since(s.name, verified.get(s.name, 0))
        for s in job.sinks
    }
    floor = _floor(engine, min(since.values(), default=0), epoch)
    every = engine.ledger.windows(since=floor)
    skipped = [(w.window_id, w.skipped) for w in every if w.skipped is not None]
    windows = [w for w in every if w.skipped is None]
    unverifiable: list[tuple[int, str]] = []
    available: list[Window] = []
    for window in windows:
        problems = job.source.check_available(settings, window.offsets)
        if problems:
            unverifiable.append((window.window_id, "; ".join(problems[:3])))
        else:
            available.append(window)
    bad = frozenset(wid for wid, _ in unverifiable)
    workdir = settings.lake / "_onceflow" / "reconcile" / job.name / uuid.uuid4().hex
    computed: Computed | None = None
    try:
        outputs: dict[str, DataFrame] = {}
        if available:
            seen = lookup = None
            if job.dedupe is not None and bad:
                seen = _seen_in(engine, bad)
            if job.dedupe is not None and floor:
                assert engine.index is not None
                lookup = engine.index.lookup(job.dedupe.key, floor + 1)
            step(f"recomputing {len(available)} window(s)")
            computed = compute(spark, job, settings, available, seen=seen, lookup=lookup)
            outputs = computed.outputs
        diffs: list[SinkDiff] = []
        checked: set[int] = set()
        newly_verified: dict[str, int] = {}
        ids = tuple(w.window_id for w in windows)
        for sink in job.sinks:
            group = engine.group_of[sink.name]
            scope = ReconcileScope(bad, since[sink.name], ids)
            step(f"comparing {sink.name}")
            found = group.reconcile(
                spark, sink.name, outputs.get(sink.output), scope, epoch=epoch, run_id=run_id,
                workdir=workdir,
            )  # fmt: skip
            if found.diff is None:
                diffs.append(SinkDiff(sink.name, 0, 0, 0, False, skipped=found.skipped))
                continue
            diff = found.diff
            diffs.append(
                SinkDiff(sink.name, diff.missing, diff.extra, diff.changed,
                         repaired=epoch is not None and not diff.empty, samples=found.samples)
            )  # fmt: skip
            checked |= found.compared
            first_bad = min(bad) if bad else None
            before = since[sink.name] if first_bad is None else min(since[sink.name], first_bad - 1)
            newly_verified[sink.name] = max(
                (w for w in found.committed if first_bad is None or w < first_bad),
                default=max(before, 0),
            )
        if epoch is not None:
            _record_verified(engine, newly_verified)
    finally:
        if computed is not None:
            computed.release()
        workdir.delete_tree()
    return ReconcileReport(
        job=job.name,
        mode=mode,
        dry_run=dry_run,
        windows_checked=sorted(checked),
        windows_recomputed=len(available),
        recomputed_after=floor,
        unverifiable=unverifiable,
        sinks=diffs,
        wall_s=time.monotonic() - started,
        replayed=replayed,
        lacking=lacking,
        skipped=skipped,
        gone=gone,
        abandoned=abandoned,
    )


def _gone(engine: Engine, lacking: dict[str, list[int]]) -> list[int]:
    """The windows among `lacking` whose input is gone (a dry run does not replay them)."""
    ids = {wid for wids in lacking.values() for wid in wids}
    return [
        w.window_id
        for w in engine.ledger.windows()
        if w.window_id in ids and engine.replay_problems(w)
    ]


def _floor(engine: Engine, floor: int, epoch: int | None) -> int:
    """`floor`, or 0 when the keys the windows through it kept cannot be looked up: a job
    that dedupes recomputes the windows after `floor` against the key index, which must hold
    exactly the completed windows through it (made so when repairing; a dry run only looks)."""
    if not floor or engine.job.dedupe is None:
        return floor
    if engine.index is None:
        return 0
    if epoch is None:
        state = engine.index.state(floor + 1)
        return 0 if state.missing or state.stale else floor
    try:
        engine.ensure_index(floor + 1, epoch)
    except (LedgerError, SinkStateError) as exc:
        _log.warning("job %s: every window is recomputed: %s", engine.job.name, exc)
        return 0
    return floor


def _seen_in(engine: Engine, windows: frozenset[int]) -> DataFrame | None:
    """The dedupe keys first kept by `windows` (whose input is gone), with `__seen_in`.

    From the state sink, and from the key index, which every run's dedupe read: the state sink
    may lack some of them (lost, or abandoned for it). The index's text form of a key is cast
    back to the key columns' types."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    job, spark = engine.job, engine.spark
    assert job.dedupe is not None
    name, keys = job.dedupe.state_sink, list(job.dedupe.key)
    seen = engine.group_of[name].seen_keys(spark, name, keys, only=sorted(windows))
    if engine.index is None:
        return seen
    rows = engine.ledger.read(
        "read the dedupe keys of windows whose input is gone",
        lambda conn: conn.execute(
            "SELECT key, window_id FROM onceflow.dedupe_keys"
            " WHERE job = %s AND window_id = ANY(%s)",
            (job.name, sorted(windows)),
        ).fetchall(),
    )
    if not rows:
        return seen
    indexed = spark.createDataFrame(
        [(str(k), int(w)) for k, w in rows], "__key string, __seen_in long"
    )
    types = {f.name: f.dataType for f in seen.schema.fields} if seen is not None else {}
    if len(keys) == 1:
        parts = [F.col("__key")]
    else:
        array = F.from_json(F.col("__key"), "array<string>")
        parts = [array.getItem(i) for i in range(len(keys))]
    from_index = indexed.select(
        *[p.cast(types.get(k, StringType())).alias(k) for p, k in zip(parts, keys, strict=True)],
        "__seen_in",
    )
    if seen is None:
        return from_index
    return seen.unionByName(from_index).groupBy(*keys).agg(F.min("__seen_in").alias("__seen_in"))
