"""What a Dagster run asks of the engine, and the report it gets back; no protocol logic here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dagster import Failure, MetadataValue

from assets.config import WindowRunConfig, format_windows, parse_windows
from onceflow.engine import Engine, WindowResult
from onceflow.sinks.delta import META_PREFIX

# Offsets of at most this many windows go into one materialisation's metadata.
MAX_OFFSETS_IN_METADATA = 50
# Commits looked at to find the newest window commit behind a run's epoch claims.
RECENT_COMMITS = 50


@dataclass
class RunReport:
    """What one run did: the windows the engine processed and those it found already done."""

    mode: str
    windows: list[WindowResult] = field(default_factory=list)
    noop_windows: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_windows(engine: Engine, config: WindowRunConfig, run_id: str, log: Any) -> RunReport:
    """Process new data, or backfill / restate the windows `config` names.

    Args:
        engine: The job's engine.
        config: The run's configuration.
        run_id: The Dagster run id, recorded with every commit.
        log: Where to say what happened (Dagster's run log).

    Raises:
        Failure: The windows spec is malformed or names windows never planned.
    """
    if not config.windows:
        if config.restate:
            raise Failure("restate needs `windows`: name the windows to restate, e.g. 3-7.")
        result = engine.run(max_files_per_window=config.max_files_per_window, run_id=run_id)
        report = RunReport("new data", result.windows)
        _log_windows(report, log)
        return report
    try:
        ids = parse_windows(config.windows)
    except ValueError as exc:
        raise Failure(str(exc)) from None
    engine.prepare()
    last = engine.ledger.last_window_id()
    unplanned = [wid for wid in ids if wid > last]
    if unplanned:
        raise Failure(
            f"windows {format_windows(unplanned)} were never planned (the last planned window is "
            f"{last}); windows are planned by a run without `windows`, which processes new data."
        )
    if config.restate:
        return _restate(engine, ids, run_id, log)
    report = RunReport("backfill")
    every = {sink.name for sink in engine.job.sinks}
    replay = []
    for wid in ids:
        held = engine.committed_sinks(wid)
        if held >= every:
            report.noop_windows.append(wid)
            log.info(f"window {wid} already committed in every sink; nothing changed")
            continue
        window = engine.ledger.window(wid)
        if window is not None and window.completed:
            note = (
                f"window {wid} is marked completed but {sorted(every - held)} do not hold it: "
                "damage from outside onceflow; run the recovery job to reconcile."
            )
            report.notes.append(note)
            log.warning(note)
        else:
            replay.append(wid)
    if replay:
        log.info(f"windows {format_windows(replay)} are pending; replaying pending windows")
        report.windows = engine.run(run_id=run_id, max_windows=0).windows
        _log_windows(report, log)
    return report


def _restate(engine: Engine, ids: list[int], run_id: str, log: Any) -> RunReport:
    report = RunReport("restate")
    for wid in ids:
        report.windows.append(engine.restate_window(wid, run_id))
        log.info(f"window {wid} restated in every sink")
    return report


def _log_windows(report: RunReport, log: Any) -> None:
    if not report.windows:
        log.info("no pending windows and no new input; nothing changed")
    for window in report.windows:
        if window.noop:
            report.noop_windows.append(window.window_id)
            log.info(f"window {window.window_id} already committed in every sink; nothing changed")
            continue
        done = sorted(n for n, s in window.sinks.items() if s.committed)
        held = sorted(n for n, s in window.sinks.items() if s.already_committed)
        log.info(
            f"window {window.window_id}: committed to {', '.join(done)}"
            + (f"; already held by {', '.join(held)}" if held else "")
        )


def sink_metadata(report: RunReport, sink: str, delta_version: int | None) -> dict[str, Any]:
    """Materialisation metadata of one sink asset for one run; counts as ints so the UI plots."""
    mine = [(w, w.sinks[sink]) for w in report.windows if sink in w.sinks]
    committed = [w for w, outcome in mine if outcome.committed]
    already = sorted(
        {w.window_id for w, o in mine if o.already_committed} | set(report.noop_windows)
    )
    seen = sorted({w.window_id for w, _ in mine} | set(report.noop_windows))

    def total(key: str) -> int:
        return sum(int(w.stats.get(key, 0) or 0) for w in committed)

    metadata: dict[str, Any] = {
        "mode": MetadataValue.text(report.mode),
        "windows": MetadataValue.text(format_windows(seen) or "none"),
        "windows_committed": MetadataValue.int(len(committed)),
        "windows_already_committed": MetadataValue.int(len(already)),
        "noop": MetadataValue.bool(not committed),
        "files": MetadataValue.int(sum(len(w.offsets.get("files", [])) for w in committed)),
        "rows_in": MetadataValue.int(total("rows_in")),
        "rows_kept": MetadataValue.int(total("kept")),
        "duplicates": MetadataValue.int(total("duplicates")),
        "quarantined": MetadataValue.int(total("quarantined")),
        "rows_written": MetadataValue.int(sum(o.rows for _, o in mine if o.committed)),
        "commit_latency_s": MetadataValue.float(
            round(float(sum(o.latency_s for _, o in mine if o.committed)), 4)
        ),
    }
    if committed:
        metadata["window_first"] = MetadataValue.int(committed[0].window_id)
        metadata["window_last"] = MetadataValue.int(committed[-1].window_id)
        metadata["offsets"] = MetadataValue.json(
            {
                str(w.window_id): {
                    "files": len(w.offsets.get("files", [])),
                    "first": (w.offsets.get("files") or [None])[0],
                    "last": (w.offsets.get("files") or [None])[-1],
                }
                for w in committed[-MAX_OFFSETS_IN_METADATA:]
            }
        )
    xids = [o.xid for _, o in mine if o.committed and o.xid]
    if xids:
        metadata["transaction_id"] = MetadataValue.text(xids[-1])
    if delta_version is not None:
        metadata["delta_version"] = MetadataValue.int(delta_version)
    if report.notes:
        metadata["notes"] = MetadataValue.md("\n".join(f"- {n}" for n in report.notes))
    return metadata


def delta_version(engine: Engine, sink: str, report: RunReport) -> int | None:
    """The Delta version holding the sink's newest window commit after the run.

    Epoch claims add empty commits to the table on every run, so the table's current version
    moves even when no data did; the newest window commit is the data's version.
    """
    versions = [
        w.sinks[sink].delta_version
        for w in report.windows
        if sink in w.sinks and w.sinks[sink].delta_version is not None
    ]
    if versions:
        return versions[-1]
    table = engine.delta[sink]
    if not table.exists():
        return None
    delta = table.table()
    for entry in delta.history(limit=RECENT_COMMITS):
        if entry.get(f"{META_PREFIX}window_id") is not None and "version" in entry:
            return int(entry["version"])
    return int(delta.version())
