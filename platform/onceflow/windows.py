"""Window ids as people write them (`3-7`, `1,4,9-10`), Delta interval properties, and the
operator's action for completed windows whose input is gone (`abandon_windows`)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError

if TYPE_CHECKING:
    from onceflow.engine import Engine

_log = logging.getLogger(__name__)

# Every multi-window frame (reconcile's expected state, the compute path) carries the window
# that produced each row in this column.
WINDOW_COL = "__onceflow_window"
# A window spec names at most this many windows; a larger backfill is several requests.
MAX_WINDOWS_PER_SPEC = 10_000

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


def parse_windows(spec: str) -> list[int]:
    """Parse a window spec (`"3-7"`, `"3,5"`, `"1-2, 9"`) into sorted, distinct window ids.

    Raises:
        ConfigurationError: The spec is malformed, names a window below 1, or names too many.
    """
    ids: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ConfigurationError(
                f"windows {spec!r}: {part!r} is not a window id or a range like 3-7"
            ) from None
        if first < 1 or last < first:
            raise ConfigurationError(f"windows {spec!r}: {part!r} must be ids >= 1, low-high")
        if last - first + 1 + len(ids) > MAX_WINDOWS_PER_SPEC:
            raise ConfigurationError(
                f"windows {spec!r}: more than {MAX_WINDOWS_PER_SPEC} windows; split the request"
            )
        ids.update(range(first, last + 1))
    if not ids:
        raise ConfigurationError(f"windows {spec!r}: no window ids given")
    return sorted(ids)


def format_windows(ids: list[int]) -> str:
    """Compact text for window ids: `[1, 2, 3, 5]` → `"1-3,5"`."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = prev = None
    for wid in ordered:
        if start is None or prev is None:
            start = prev = wid
        elif wid == prev + 1:
            prev = wid
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = wid
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)


def parse_interval(text: str) -> timedelta:
    """A Delta interval property (`interval 7 days`, `2 weeks 3 days`) as a timedelta.

    Raises:
        ConfigurationError: When the text is not an interval of known units.
    """
    body = text.strip().lower().removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(body)
    if not parts or _INTERVAL_PART.sub("", body).strip():
        raise ConfigurationError(f"{text!r} is not a Delta interval such as 'interval 7 days'.")
    total = timedelta()
    for number, unit in parts:
        if unit not in _UNITS:
            raise ConfigurationError(f"{text!r}: unknown unit {unit!r}.")
        total += int(number) * _UNITS[unit]
    return total


@dataclass(frozen=True)
class Abandoned:
    """What `abandon_windows` recorded.

    Attributes:
        windows: Window id → the sinks it was abandoned for now (empty when every window asked
            for was abandoned before).
        lacking: Sink → completed windows it still lacks (not abandoned): later windows that
            `onceflow reconcile` can now replay into it.
    """

    windows: dict[int, list[str]]
    lacking: dict[str, list[int]]


def abandon_windows(
    engine: Engine, window_ids: Sequence[int], reason: str, run_id: str | None = None
) -> Abandoned:
    """Give up completed windows that some sink lacks and cannot get back, their input being
    gone: recorded per (window, sink) with the reason, a known gap from then on.

    Takes a new epoch first (so a run is fenced, as a skip does) and checks every window
    before recording anything.

    Raises:
        ConfigurationError: No reason; a window never planned, skipped, pending (that is
            `windows skip`), held by every sink, or whose input is still readable (then
            reconcile replays it).
    """
    job = engine.job.name
    if not reason.strip():
        raise ConfigurationError("say why the windows are abandoned (--reason); it is recorded.")
    epoch = engine.start(run_id or f"abandon-{uuid.uuid4().hex}")
    ledger = engine.ledger
    wanted = sorted(set(window_ids))
    held = engine.held(wanted)
    before = ledger.abandoned()
    todo: dict[int, list[str]] = {}
    for wid in wanted:
        window = ledger.window(wid)
        if window is None:
            raise ConfigurationError(f"job {job}: window {wid} was never planned.")
        if window.skipped is not None:
            raise ConfigurationError(
                f"job {job}: window {wid} was skipped ({window.skipped}); no sink has rows of "
                "it, there is nothing to abandon."
            )
        if not window.completed:
            raise ConfigurationError(
                f"job {job}: window {wid} is not completed; a pending window whose input is "
                f'gone is given up with `onceflow windows skip {job} {wid} --reason "…"`.'
            )
        lacking = [
            n for n in engine.sink_names if n not in held[wid] and wid not in before.get(n, ())
        ]
        if not lacking:
            if any(wid in ids for ids in before.values()):
                continue  # abandoned before, for every sink that lacks it
            raise ConfigurationError(
                f"job {job}: every sink holds window {wid}; there is nothing to abandon."
            )
        if not engine.replay_problems(window):
            raise ConfigurationError(
                f"job {job}: window {wid}'s input is still readable, so it is not lost: run "
                f"`onceflow reconcile {job}` to replay it into {', '.join(lacking)} instead."
            )
        todo[wid] = lacking
    if todo:
        ledger.abandon_windows(epoch, todo, reason.strip())
        _log.warning(
            "job %s: %s abandoned: %s",
            job,
            "; ".join(f"window {w} for {', '.join(s)}" for w, s in todo.items()),
            reason.strip(),
        )
    return Abandoned(todo, engine.lacking_windows())


@dataclass(frozen=True)
class Recomputed:
    """What `recompute_windows` did.

    Attributes:
        windows: The windows asked for whose stage was dropped (their outputs are computed
            again, with the job's current code, by the next run).
        later: Later pending windows whose stage was dropped with them: their dedupe looked
            up the keys of the windows asked for.
        deterministic: The job stages nothing: its pending windows are always computed again.
    """

    windows: list[int]
    later: list[int]
    deterministic: bool


def recompute_windows(
    engine: Engine, window_ids: Sequence[int], run_id: str | None = None
) -> Recomputed:
    """Have pending windows that no sink holds computed again with the job's current code:
    their stage (the outputs the code of an earlier run computed) is dropped, their input and
    their place in the ledger kept, so the next run computes and commits them afresh.

    Checks every window before changing anything, takes a new epoch (so a run working on the
    windows is fenced) and checks again under it.

    Raises:
        ConfigurationError: A window never planned, skipped, committed in every sink, held
            by some sink (the sinks would disagree), or whose input is no longer readable (its
            stage is then all that is left of it); with a dedupe, a later window some sink
            holds (its dedupe saw these windows' keys).
    """
    from onceflow._staging import WindowStage

    job = engine.job.name
    wanted = sorted(set(window_ids))

    def check() -> tuple[list[int], list[int]]:
        for wid in wanted:
            window = engine.ledger.window(wid)
            if window is None:
                raise ConfigurationError(
                    f"job {job}: window {wid} was never planned; nothing was changed."
                )
            if window.skipped is not None:
                raise ConfigurationError(
                    f"job {job}: window {wid} was skipped ({window.skipped}); there is nothing "
                    "to compute. Nothing was changed."
                )
            if window.completed:
                raise ConfigurationError(
                    f"job {job}: window {wid} is committed in every sink; change a committed "
                    f"window with `onceflow restate {job} --windows {wid}`. Nothing was changed."
                )
            lost = engine.job.source.check_available(engine.settings, window.offsets)
            if lost:
                raise ConfigurationError(
                    f"job {job}: window {wid}'s input is no longer readable "
                    f"({'; '.join(lost[:3])}): its stage is all that is left of it, so it is "
                    f"kept. Restore the input, or give the window up with `onceflow windows "
                    f'skip {job} {wid} --reason "…"`. Nothing was changed.'
                )
        later: list[int] = []
        if engine.job.dedupe is not None:
            later = [
                w.window_id
                for w in engine.ledger.windows(pending_only=True, since=wanted[0])
                if w.window_id not in wanted and w.skipped is None
            ]
        held = engine.held([*wanted, *later])
        partly = {wid: sorted(names) for wid, names in held.items() if names}
        if partly:
            which = "; ".join(f"window {w} is held by {', '.join(n)}" for w, n in partly.items())
            raise ConfigurationError(
                f"job {job}: {which}. Computing it again would leave the sinks apart for good: "
                f"run `onceflow run {job}` to finish it with the rows it has, then change them "
                f"with `onceflow restate {job} --windows …`. Nothing was changed."
            )
        return wanted, later

    # Checked before the epoch (which fences a running job) and again under it.
    engine.prepare()
    engine.rebuild_ledger()
    check()
    if engine.job.deterministic:
        return Recomputed([], [], True)
    engine.start(run_id or f"recompute-{uuid.uuid4().hex}")
    windows, later = check()
    for wid in [*windows, *later]:
        WindowStage(engine.settings.lake, job, wid, {}).discard()
    _log.warning(
        "job %s: the stages of windows %s dropped; the next run computes them again",
        job,
        format_windows([*windows, *later]),
    )
    return Recomputed(windows, later, False)
