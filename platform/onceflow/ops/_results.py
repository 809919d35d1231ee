"""What each operation returns: plain, frozen data with `as_json()`, no orchestrator types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceflow.engine import WindowResult
    from onceflow.quality import ValidationReport
    from onceflow.reconcile import ReconcileReport


@dataclass(frozen=True)
class SinkDone:
    """What one sink did with one window.

    Attributes:
        sink: The sink's name.
        committed: This operation wrote the window to it.
        already_committed: It held the window before (nothing written).
        rows: Rows written.
        data_version: The sink's data version holding the window (a Delta table version),
            when the sink is versioned.
        commit_ref: The sink's reference of the commit (a PostgreSQL transaction id).
        latency_s: Seconds its commit took.
    """

    sink: str
    committed: bool
    already_committed: bool
    rows: int = 0
    data_version: int | None = None
    commit_ref: str | None = None
    latency_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "sink": self.sink,
            "committed": self.committed,
            "already_committed": self.already_committed,
            "rows": self.rows,
            "data_version": self.data_version,
            "commit_ref": self.commit_ref,
            "latency_s": round(self.latency_s, 4),
        }


@dataclass(frozen=True)
class WindowDone:
    """What an operation did with one window: its offsets, its counts, each sink's commit."""

    window_id: int
    offsets: dict[str, Any]
    stats: dict[str, Any]
    sinks: tuple[SinkDone, ...] = ()
    latency_s: float = 0.0

    @property
    def noop(self) -> bool:
        """Every sink held the window already: nothing changed."""
        return all(s.already_committed for s in self.sinks)

    def sink(self, name: str) -> SinkDone | None:
        return next((s for s in self.sinks if s.sink == name), None)

    @classmethod
    def of(cls, result: WindowResult) -> WindowDone:
        # The one place that reads the engine's per-sink outcome fields.
        sinks = tuple(
            SinkDone(
                name,
                o.committed,
                o.already_committed,
                o.rows,
                o.data_version,
                o.commit_ref,
                o.latency_s,
            )
            for name, o in result.sinks.items()
        )
        return cls(
            result.window_id,
            dict(result.offsets),
            dict(result.stats or {}),
            sinks,
            result.latency_s,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "window_id": self.window_id,
            "noop": self.noop,
            "offsets": self.offsets,
            "stats": self.stats,
            "sinks": [s.as_json() for s in self.sinks],
            "latency_s": round(self.latency_s, 4),
        }


@dataclass(frozen=True)
class WindowsResult:
    """What a run, a backfill or a restatement did.

    Attributes:
        kind: `run`, `backfill` or `restate`.
        job: The job's name.
        run_id: The id the commits were recorded with; the same id again is the same request.
        windows: The windows processed, in order.
        noop_windows: Windows every sink held already (nothing changed), among `windows` or
            named by a backfill.
        notes: What was left alone and why (a skipped window, damage only reconcile repairs).
        epoch: The run's epoch (a run's; None where the operation does not report it).
        request_id: A restatement's request (its retries restate each window once).
    """

    kind: str
    job: str
    run_id: str
    windows: tuple[WindowDone, ...] = ()
    noop_windows: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    epoch: int | None = None
    request_id: str | None = None

    @property
    def committed(self) -> tuple[WindowDone, ...]:
        """The windows some sink committed in this operation."""
        return tuple(w for w in self.windows if not w.noop)

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": self.kind,
            "job": self.job,
            "run_id": self.run_id,
            "epoch": self.epoch,
            "request_id": self.request_id,
            "windows": [w.as_json() for w in self.windows],
            "windows_committed": [w.window_id for w in self.committed],
            "noop_windows": list(self.noop_windows),
            "rows_written": sum(s.rows for w in self.windows for s in w.sinks if s.committed),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RecoverResult:
    """What a recovery did: windows put back into sinks that lost them, pending windows and
    unplanned input committed, the last windows verified, the sinks reconciled.

    Attributes:
        job: The job's name.
        run_id: The recovery's run id.
        restored: Per sink, completed windows it had lost and that were committed to it again.
        replayed: The windows the recovery's run processed (pending, then new input).
        verified: The windows whose commit state was checked in every sink.
        incomplete: Of those, windows some sink still lacks, with those sinks.
        reconcile: The reconciliation's report; None when it was off.
        epoch: The recovery run's epoch.
    """

    job: str
    run_id: str
    restored: dict[str, list[int]] = field(default_factory=dict)
    replayed: tuple[WindowDone, ...] = ()
    verified: tuple[int, ...] = ()
    incomplete: dict[int, list[str]] = field(default_factory=dict)
    reconcile: ReconcileReport | None = None
    epoch: int | None = None

    @property
    def ok(self) -> bool:
        """Every verified window is held by every sink (but known, abandoned gaps)."""
        return not self.incomplete

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "recover",
            "job": self.job,
            "run_id": self.run_id,
            "epoch": self.epoch,
            "ok": self.ok,
            "restored": self.restored,
            "replayed": [w.as_json() for w in self.replayed],
            "windows_replayed": [w.window_id for w in self.replayed if not w.noop],
            "windows_verified": len(self.verified),
            "incomplete": {str(w): s for w, s in self.incomplete.items()},
            "reconcile": self.reconcile.as_json() if self.reconcile is not None else None,
        }


@dataclass(frozen=True)
class SkipResult:
    """Pending windows given up, with the reason recorded."""

    job: str
    windows: tuple[int, ...]
    reason: str
    run_id: str

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "skip",
            "job": self.job,
            "run_id": self.run_id,
            "windows": list(self.windows),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class ValidateResult:
    """Every quality check of a job's sinks."""

    report: ValidationReport

    @property
    def passed(self) -> bool:
        return self.report.passed

    def as_json(self) -> dict[str, Any]:
        report = self.report
        return {
            "operation": "validate",
            "job": report.job,
            "passed": report.passed,
            "through_window": report.through_window,
            "checks": [
                {"sink": r.sink, "check": r.check, "passed": r.passed, "observed": r.observed}
                for r in report.results
            ],
            "data_docs": report.data_docs,
        }


@dataclass(frozen=True)
class StatusResult:
    """A job's state as plain data (`onceflow.status.job_status`)."""

    job: str
    status: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return self.status


@dataclass(frozen=True)
class RecomputeResult:
    """What `recompute` dropped: the stages of `windows` and of `later` windows whose dedupe
    looked up their keys; `deterministic` when the job stages nothing (nothing to drop)."""

    job: str
    windows: tuple[int, ...]
    later: tuple[int, ...] = ()
    deterministic: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "recompute",
            "ok": True,
            "job": self.job,
            "windows": list(self.windows),
            "later": list(self.later),
            "deterministic": self.deterministic,
        }


@dataclass(frozen=True)
class AbandonResult:
    """What `abandon` recorded: window → the sinks it is abandoned for now (empty when every
    window was abandoned before), and sink → completed windows it still lacks (a reconcile
    replays those)."""

    job: str
    reason: str
    windows: dict[int, tuple[str, ...]]
    lacking: dict[str, tuple[int, ...]]

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "abandon",
            "ok": True,
            "job": self.job,
            "reason": self.reason,
            "windows": {str(w): list(s) for w, s in self.windows.items()},
            "lacking": {s: list(w) for s, w in self.lacking.items()},
        }


@dataclass(frozen=True)
class RestatementItem:
    """One window's restatement of a request."""

    window_id: int
    seq: int
    cancelled: str | None


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_restatement` did: the request's restatements cancelled (now or by an
    earlier cancel), and those that had finished (they stay)."""

    job: str
    request: str
    reason: str
    cancelled: tuple[RestatementItem, ...]
    finished: tuple[RestatementItem, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "cancel_restatement",
            "ok": True,
            "job": self.job,
            "request": self.request,
            "reason": self.reason,
            "cancelled": [{"window_id": i.window_id, "seq": i.seq} for i in self.cancelled],
            "finished": [{"window_id": i.window_id, "seq": i.seq} for i in self.finished],
        }


@dataclass(frozen=True)
class JobInfo:
    """One registered job, described: its source, its sinks (name, description), guarantee."""

    name: str
    source: str
    sinks: tuple[tuple[str, str], ...]
    guarantee: str


@dataclass(frozen=True)
class JobsResult:
    """The jobs onceflow finds, and where it found them."""

    origin: str
    jobs: tuple[JobInfo, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": "jobs",
            "ok": True,
            "origin": self.origin,
            "jobs": [
                {
                    "name": j.name,
                    "source": j.source,
                    "sinks": [{"name": n, "describe": d} for n, d in j.sinks],
                    "guarantee": j.guarantee,
                }
                for j in self.jobs
            ],
        }


@dataclass(frozen=True)
class GenerateResult:
    """What `generate` wrote into the landing folder."""

    job: str
    folder: str
    files: int
    payments: int
    duplicates: int
    invalid: int

    def as_json(self) -> dict[str, Any]:
        return {"operation": "generate", "ok": True, **self.__dict__}
