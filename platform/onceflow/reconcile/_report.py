"""What a reconciliation found and did: per-sink counts and the windows it could not check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onceflow._diff import DiffSample


@dataclass(frozen=True)
class SinkDiff:
    """The difference between one sink and its expected state.

    Attributes:
        sink: The sink's name.
        missing: Expected rows (or row copies, for keyless sinks) the sink lacks.
        extra: Rows (or copies) the sink holds that it should not.
        changed: Keys present on both sides with different values (keyed sinks only; a
            keyless sink reports a changed row as one missing and one extra copy).
        repaired: True when the difference was applied to the sink.
        skipped: Why the sink was not compared, or None when it was.
        samples: The first differences of each kind, by key only (a keyless sink: by window),
            never other columns' values.
    """

    sink: str
    missing: int
    extra: int
    changed: int
    repaired: bool
    skipped: str | None = None
    samples: tuple[DiffSample, ...] = ()

    @property
    def clean(self) -> bool:
        return self.skipped is None and self.missing == self.extra == self.changed == 0

    def explained(self) -> dict[str, list[str]]:
        """The samples as text, by kind (`missing`, `extra`, `changed`)."""
        out: dict[str, list[str]] = {}
        for sample in self.samples:
            out.setdefault(sample.kind, []).append(sample.describe())
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "sink": self.sink,
            "missing": self.missing,
            "extra": self.extra,
            "changed": self.changed,
            "repaired": self.repaired,
            "skipped": self.skipped,
            "clean": self.clean,
            "first_differences": [s.as_json() for s in self.samples],
        }


@dataclass(frozen=True)
class ReconcileReport:
    """The outcome of one reconciliation of a job.

    Attributes:
        job: The job's name.
        mode: `full` or `incremental`.
        dry_run: True when nothing was repaired.
        windows_checked: Windows whose rows were compared with their expected state.
        unverifiable: Windows whose input is gone or changed, with the reason; their rows
            were left alone.
        sinks: One entry per sink.
        wall_s: Wall-clock seconds the reconciliation took.
        replayed: Per sink, completed windows it lacked (a lake lost or restored from an older
            copy) and that were committed to it again.
        lacking: Per sink, completed windows it lacks and that were not replayed (a dry run,
            their input is gone, or an earlier window it lacks has no input).
        skipped: Windows an operator skipped, with the reason; they have no rows anywhere.
        gone: Windows among `lacking` whose input is gone: they cannot be replayed, only
            abandoned for those sinks (`onceflow windows abandon`).
        abandoned: (window, sink, reason) of windows an operator abandoned for a sink: a
            known gap there, not replayed and not counted as lacking.
        windows_recomputed: How many windows' input was read and recomputed.
        recomputed_after: The windows after this one were recomputed (incremental mode: the
            lowest point every sink compares from; 0: every window).
    """

    job: str
    mode: str
    dry_run: bool
    windows_checked: list[int]
    unverifiable: list[tuple[int, str]]
    sinks: list[SinkDiff]
    wall_s: float
    replayed: dict[str, list[int]] = field(default_factory=dict)
    lacking: dict[str, list[int]] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)
    abandoned: list[tuple[int, str, str]] = field(default_factory=list)
    windows_recomputed: int = 0
    recomputed_after: int = 0

    @property
    def clean(self) -> bool:
        """True when every sink matched its expected state, held every completed window (but
        the abandoned ones: known gaps), and every window was checkable."""
        return not self.unverifiable and not self.lacking and all(s.clean for s in self.sinks)

    def as_json(self) -> dict[str, Any]:
        """The report as plain data (`onceflow reconcile --json`): counts, windows and the
        first differing keys, never other columns' values."""
        return {
            "job": self.job,
            "mode": self.mode,
            "dry_run": self.dry_run,
            "clean": self.clean,
            "windows_checked": sorted(self.windows_checked),
            "windows_recomputed": self.windows_recomputed,
            "recomputed_after": self.recomputed_after,
            "unverifiable": [{"window_id": w, "reason": r} for w, r in self.unverifiable],
            "skipped": [{"window_id": w, "reason": r} for w, r in self.skipped],
            "replayed": self.replayed,
            "lacking": self.lacking,
            "sinks": [s.as_json() for s in self.sinks],
            "wall_s": round(self.wall_s, 3),
        }


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    parts: list[str] = []
    start = prev = ids[0]
    for wid in [*ids[1:], None]:
        if wid is not None and wid == prev + 1:
            prev = wid
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if wid is not None:
            start = prev = wid
    return ", ".join(parts)


def format_report(report: ReconcileReport) -> str:
    """Render a report as the `onceflow reconcile` command prints it.

    Args:
        report: What `reconcile` returned.

    Returns:
        A few lines of text: the windows checked, any unverifiable windows, and per sink
        the missing, extra and changed counts and whether they were repaired.
    """
    action = "dry run" if report.dry_run else "repair"
    lines = [
        f"reconcile {report.job} ({report.mode}, {action}) in {report.wall_s:.1f}s",
        f"windows checked: {_ranges(sorted(report.windows_checked))}",
        f"windows recomputed: {report.windows_recomputed}"
        + (f" (those after window {report.recomputed_after})" if report.recomputed_after else ""),
    ]
    for sink, ids in report.replayed.items():
        lines.append(f"{sink}: lacked committed windows {_ranges(ids)}; replayed into it")
    gone = set(report.gone)
    for sink, ids in report.lacking.items():
        lost = [w for w in ids if w in gone]
        rest = [w for w in ids if w not in gone]
        if lost:
            lines.append(
                f"{sink}: lacks committed windows {_ranges(lost)} and their input is gone; "
                f"only `onceflow windows abandon {report.job} {_ranges(lost).replace(', ', ',')}"
                ' --reason "…"` gets past them (a recorded gap)'
            )
        if rest:
            if report.dry_run:
                state = "run without --dry-run to replay them"
            else:
                state = "behind a window whose input is gone; replayed once it is abandoned"
            lines.append(f"{sink}: lacks committed windows {_ranges(rest)} ({state})")
    for wid, reason in report.skipped:
        lines.append(f"window {wid}: skipped by an operator ({reason}); no rows expected")
    for wid, sink, reason in report.abandoned:
        lines.append(
            f"window {wid}: abandoned for {sink} by an operator ({reason}); a known gap there"
        )
    for wid, reason in report.unverifiable:
        lines.append(f"window {wid}: unverifiable, input gone ({reason}); its rows left alone")
    width = max([len(s.sink) for s in report.sinks] + [4])
    lines.append(f"{'sink':<{width}}  {'missing':>8}  {'extra':>8}  {'changed':>8}  state")
    for s in report.sinks:
        if s.skipped is not None:
            state = f"not checked: {s.skipped}"
        elif s.clean:
            state = "ok"
        elif s.repaired:
            state = "repaired"
        else:
            state = "differs" if report.dry_run else "differs, not repaired"
        lines.append(f"{s.sink:<{width}}  {s.missing:>8}  {s.extra:>8}  {s.changed:>8}  {state}")
    for s in report.sinks:
        totals = {"missing": s.missing, "extra": s.extra, "changed": s.changed}
        for kind, items in s.explained().items():
            shown = sum(x.rows for x in s.samples if x.kind == kind)
            more = totals[kind] - shown
            lines.append(
                f"{s.sink} {kind}: {'; '.join(items)}"
                + (f"; and {more} more row(s)" if more > 0 else "")
            )
    lines.append("clean" if report.clean else "NOT clean")
    return "\n".join(lines)
