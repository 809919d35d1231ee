"""`onceflow status`: windows, offsets, per-sink commit state and lag."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow._ledger_scan import window_summary
from onceflow.errors import ConfigurationError
from onceflow.runs.changed import changed_input, changed_input_message
from onceflow.sources.base import ChangedUnit

if TYPE_CHECKING:
    from onceflow.engine import Engine

_log = logging.getLogger(__name__)


def source_problem(engine: Engine) -> str | None:
    """Why the job's source cannot be read at all (its folder is missing), or None."""
    try:
        engine.job.source.check_input(engine.settings)
    except ConfigurationError as exc:
        return exc.message
    return None


@dataclass(frozen=True)
class PendingWork:
    """What a job still has to do, from the ledger and the source (no Spark).

    Attributes:
        unplanned: Visible input units no window has taken yet.
        pending_windows: Planned windows not yet committed to every sink.
        oldest_unplanned_age_s: Age of the oldest unplanned unit, when the source knows it.
    """

    unplanned: int
    pending_windows: tuple[int, ...]
    oldest_unplanned_age_s: float | None

    @property
    def any(self) -> bool:
        return bool(self.unplanned or self.pending_windows)


def pending_work(engine: Engine) -> PendingWork:
    """What the job has not yet planned or committed: the trigger for its next run.

    Derived from the ledger, not from what a launched run was meant to do, so input is never
    left behind by a run that died before it planned anything.
    """
    engine.prepare()
    units = engine.unplanned_units()
    source, settings = engine.job.source, engine.settings
    ages = [a for u in units if (a := source.unit_age_s(settings, u)) is not None]
    pending = tuple(w.window_id for w in engine.ledger.windows(pending_only=True))
    return PendingWork(len(units), pending, max(ages) if ages else None)


@dataclass(frozen=True)
class Freshness:
    """Whether the job's visible input is planned into windows within its freshness bound.

    Attributes:
        bound_s: The job's `freshness_s`.
        unplanned: Visible input units no window has taken yet.
        oldest_unplanned_age_s: Age of the oldest of them, when the source knows it.
        changed: Committed input that changed after its window committed (a warning: the
            change is never delivered).
    """

    bound_s: float
    unplanned: int
    oldest_unplanned_age_s: float | None
    changed: tuple[ChangedUnit, ...] = ()

    @property
    def fresh(self) -> bool:
        age = self.oldest_unplanned_age_s
        return age is None or age <= self.bound_s


def freshness(engine: Engine) -> Freshness:
    """The job's freshness: input left unplanned for longer than its bound makes it stale;
    committed input that changed since is reported with it."""
    work = pending_work(engine)
    return Freshness(
        engine.job.freshness_s,
        work.unplanned,
        work.oldest_unplanned_age_s,
        tuple(changed_input(engine)),
    )


@dataclass(frozen=True)
class OpenItems:
    """What an operator must know is not finished or was given up.

    Attributes:
        restatements: Restatements written ahead and not applied yet: (seq, window, request).
        skipped: Windows an operator skipped: (window id, reason).
        abandoned: Completed windows an operator abandoned for a sink that lost them and
            cannot get them back: (window id, sink, reason), a known gap in that sink.
        cancelled: Restatements an operator cancelled: (seq, window, request, reason).
    """

    restatements: tuple[tuple[int, int, str], ...]
    skipped: tuple[tuple[int, str], ...]
    abandoned: tuple[tuple[int, str, str], ...] = ()
    cancelled: tuple[tuple[int, int, str, str], ...] = ()


def open_items(engine: Engine) -> OpenItems:
    """Unfinished restatements, skipped and abandoned windows, cancelled restatements (shown
    until they are gone; skips, abandonments and cancels stay: they are the operator's
    record)."""
    engine.prepare()
    ledger = engine.ledger
    return OpenItems(
        tuple(ledger.pending_restatements()),
        tuple(ledger.skipped_windows()),
        tuple(ledger.abandoned_reasons()),
        tuple(
            (r.seq, r.window_id, r.request_id, r.cancelled or "")
            for r in engine.ledger.cancelled_restatements()
        ),
    )


# How many of the newest windows the status lists one by one.
RECENT_WINDOWS = 10


def job_status(engine: Engine, lineage_windows: int = RECENT_WINDOWS) -> dict[str, Any]:
    """The job's state, as plain data (JSON-serialisable): epoch, sinks' commit state, lag,
    recent windows, and the newest `lineage_windows` rows of `onceflow.lineage`."""
    from onceflow.lineage import lineage
    from onceflow.runs.restate import cancel_command, request_of

    engine.prepare()
    ledger = engine.ledger
    summary = window_summary(ledger, RECENT_WINDOWS)
    recent = summary.recent
    held = engine.held([w.window_id for w in recent])
    abandoned = ledger.abandoned_reasons()
    gaps: dict[int, list[str]] = {}
    for wid, sink, _ in abandoned:
        gaps.setdefault(wid, []).append(sink)
    sinks: dict[str, Any] = {}
    for group in engine.groups:
        sinks.update(group.status())
    source = engine.job.source
    settings = engine.settings
    unplanned = engine.unplanned_units()
    ages = [a for u in unplanned if (a := source.unit_age_s(settings, u)) is not None]
    sizes = [s for u in unplanned if (s := source.unit_size(settings, u)) is not None]
    changed = changed_input(engine)
    return {
        "job": engine.job.name,
        "source": source.describe(),
        "source_location": source.location(settings),
        "source_problem": source_problem(engine),
        "changed_input": [
            {"window_id": c.window_id, "unit": c.unit, "detail": c.detail} for c in changed
        ],
        "guarantee": engine.job.guarantee.value,
        "epoch": ledger.current_epoch(),
        "windows": summary.count,
        "last_window": summary.last,
        "pending": summary.pending,
        "skipped": [{"window_id": wid, "reason": reason} for wid, reason in summary.skipped],
        "abandoned": [
            {"window_id": wid, "sink": sink, "reason": reason} for wid, sink, reason in abandoned
        ],
        "restatements_pending": [
            {
                "seq": seq,
                "window_id": wid,
                "request_id": req,
                "request": request_of(req),
                "cancel": cancel_command(engine.job.name, req),
            }
            for seq, wid, req in ledger.pending_restatements()
        ],
        "restatements_cancelled": [
            {
                "seq": r.seq,
                "window_id": r.window_id,
                "request_id": r.request_id,
                "request": request_of(r.request_id),
                "reason": r.cancelled,
            }
            for r in ledger.cancelled_restatements()[-RECENT_WINDOWS:]
        ],
        "sinks": sinks,
        "recent": [
            {
                "window_id": w.window_id,
                "units": source.units(w.offsets),
                "offsets": w.offsets,
                "completed": w.completed,
                "skipped": w.skipped,
                "stats": w.stats,
                "sinks": {name: name in held[w.window_id] for name in engine.sink_names},
                "abandoned": gaps.get(w.window_id, []),
            }
            for w in recent
        ],
        "lag": {
            "unplanned_units": len(unplanned),
            "unplanned_bytes": sum(sizes),
            "oldest_unplanned_age_s": round(max(ages), 1) if ages else 0.0,
            "freshness_s": engine.job.freshness_s,
            "fresh": not ages or max(ages) <= engine.job.freshness_s,
        },
        "lineage": [
            row.as_json() for row in lineage(engine.dsn, engine.job.name, limit=lineage_windows)
        ],
    }


def format_status(status: dict[str, Any]) -> str:
    """Human-readable status."""
    location = status.get("source_location")
    lines = [
        f"job {status['job']} ({status['guarantee']}), epoch {status['epoch']}",
        f"source: {status['source']}" + (f" at {location}" if location else ""),
    ]
    if status.get("source_problem"):
        lines.append(f"  WARNING: {status['source_problem']}")
    changed = status.get("changed_input") or []
    if changed:
        units = [ChangedUnit(c["window_id"], c["unit"], c["detail"]) for c in changed]
        lines.append(f"  WARNING: {changed_input_message(status['job'], units)}")
    lines += [
        f"windows: {status['windows']} planned, last {status['last_window']}, "
        f"pending {status['pending'] or 'none'}",
    ]
    if status["restatements_pending"]:
        pending = ", ".join(
            f"window {r['window_id']} (seq {r['seq']}, request {r['request']})"
            for r in status["restatements_pending"]
        )
        cancels = sorted({r["cancel"] for r in status["restatements_pending"]})
        lines.append(
            f"restatements not finished: {pending} (the next run finishes them; "
            f"`{'`, `'.join(cancels)}` gives them up)"
        )
    for r in status.get("restatements_cancelled", []):
        lines.append(
            f"restatement of window {r['window_id']} cancelled (seq {r['seq']}, request "
            f"{r['request']}): {r['reason']}"
        )
    for skip in status["skipped"]:
        lines.append(f"window {skip['window_id']} skipped: {skip['reason']}")
    for gap in status["abandoned"]:
        lines.append(
            f"window {gap['window_id']} abandoned for {gap['sink']}: {gap['reason']} (a known "
            "gap: the sink lacks its rows)"
        )
    lines.append("sinks:")
    for name, sink in status["sinks"].items():
        lines.append(
            f"  {name:<24} {sink['kind']:<8} committed through window {sink['committed_through']}"
        )
    lag = status["lag"]
    lines.append(
        f"lag: {lag['unplanned_units']} unplanned unit(s), {lag['unplanned_bytes']} bytes, "
        f"oldest {lag['oldest_unplanned_age_s']}s"
        + ("" if lag["fresh"] else f" (STALE: older than the job's {lag['freshness_s']}s bound)")
    )
    if status["recent"]:
        lines.append("recent windows:")
    for w in status["recent"]:
        units = w["units"]
        first = units[0] if units else "-"
        more = f" +{len(units) - 1}" if len(units) > 1 else ""
        missing = [n for n, ok in w["sinks"].items() if not ok and n not in w["abandoned"]]
        state = "complete" if not missing else f"missing in {', '.join(missing)}"
        if w["abandoned"]:
            state += f", abandoned for {', '.join(w['abandoned'])}"
        if w["skipped"] is not None:
            state = f"skipped ({w['skipped']})"
        stats = w["stats"] or {}
        lines.append(
            f"  {w['window_id']:>6}  {first}{more}  kept={stats.get('kept', '?')} "
            f"dup={stats.get('duplicates', '?')} quarantined={stats.get('quarantined', '?')}  {state}"
        )
    return "\n".join(lines)
