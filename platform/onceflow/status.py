"""`onceflow status`: windows, offsets, per-sink commit state and lag."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceflow.engine import Engine

# How many of the newest windows the status lists one by one.
RECENT_WINDOWS = 10


def job_status(engine: Engine) -> dict[str, Any]:
    """The job's state, as plain data (JSON-serialisable)."""
    engine.prepare()
    ledger = engine.ledger
    windows = ledger.windows()
    pg_markers = {name: set(ledger.markers(name)) for name in engine.postgres}
    delta_through = {name: sink.committed_through() for name, sink in engine.delta.items()}

    def held(window_id: int) -> dict[str, bool]:
        state = {name: through >= window_id for name, through in delta_through.items()}
        state.update({name: window_id in ids for name, ids in pg_markers.items()})
        return state

    root = engine.settings.landing
    visible = engine.job.source.discover(root)
    unplanned = ledger.unplanned(visible)
    now = time.time()
    ages = [now - (root / f).stat().st_mtime for f in unplanned if (root / f).exists()]
    sinks: dict[str, Any] = {}
    for name, through in delta_through.items():
        sinks[name] = {"kind": "delta", "committed_through": through}
    for name, ids in pg_markers.items():
        sinks[name] = {
            "kind": "postgres",
            "committed_windows": len(ids),
            "committed_through": max(ids, default=0),
        }
    return {
        "job": engine.job.name,
        "guarantee": engine.job.guarantee.value,
        "epoch": ledger.current_epoch(),
        "windows": len(windows),
        "last_window": windows[-1].window_id if windows else 0,
        "pending": [w.window_id for w in windows if not w.completed],
        "sinks": sinks,
        "recent": [
            {
                "window_id": w.window_id,
                "files": w.offsets.get("files", []),
                "completed": w.completed,
                "stats": w.stats,
                "sinks": held(w.window_id),
            }
            for w in windows[-RECENT_WINDOWS:]
        ],
        "lag": {
            "unplanned_files": len(unplanned),
            "unplanned_bytes": sum(
                (root / f).stat().st_size for f in unplanned if (root / f).exists()
            ),
            "oldest_unplanned_age_s": round(max(ages), 1) if ages else 0.0,
        },
    }


def format_status(status: dict[str, Any]) -> str:
    """Human-readable status."""
    lines = [
        f"job {status['job']} ({status['guarantee']}), epoch {status['epoch']}",
        f"windows: {status['windows']} planned, last {status['last_window']}, "
        f"pending {status['pending'] or 'none'}",
        "sinks:",
    ]
    for name, sink in status["sinks"].items():
        lines.append(
            f"  {name:<24} {sink['kind']:<8} committed through window {sink['committed_through']}"
        )
    lag = status["lag"]
    lines.append(
        f"lag: {lag['unplanned_files']} unplanned file(s), {lag['unplanned_bytes']} bytes, "
        f"oldest {lag['oldest_unplanned_age_s']}s"
    )
    if status["recent"]:
        lines.append("recent windows:")
    for w in status["recent"]:
        files = w["files"]
        first = files[0] if files else "-"
        more = f" +{len(files) - 1}" if len(files) > 1 else ""
        missing = [n for n, ok in w["sinks"].items() if not ok]
        state = "complete" if not missing else f"missing in {', '.join(missing)}"
        stats = w["stats"] or {}
        lines.append(
            f"  {w['window_id']:>6}  {first}{more}  kept={stats.get('kept', '?')} "
            f"dup={stats.get('duplicates', '?')} quarantined={stats.get('quarantined', '?')}  {state}"
        )
    return "\n".join(lines)
