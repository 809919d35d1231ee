"""The operator's actions on windows: abandon completed windows whose input is gone for the sinks
that lack them (`abandon_windows`), compute pending windows again (`recompute_windows`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError
from onceflow.windows import format_windows

if TYPE_CHECKING:
    from onceflow.engine import Engine

_log = logging.getLogger(__name__)


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
