"""A sequence of windows through the stages, each prepared while the one before it commits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from onceflow.ledger import Window
from onceflow.window.commit import commit
from onceflow.window.context import JobContext
from onceflow.window.prepare import Prepared, discard, drop_keys, fresh, prepare
from onceflow.window.results import WindowResult


def process_window(ctx: JobContext, window: Window, epoch: int, run_id: str) -> WindowResult:
    """Commit `window` to every sink that does not hold it yet."""
    return commit(ctx, fresh(ctx, prepare(ctx, window, epoch, run_id)))


def process(
    ctx: JobContext,
    windows: Iterator[Window],
    epoch: int,
    run_id: str,
    done: Callable[[WindowResult], None],
    *,
    stop: threading.Event | None = None,
    limit: int | None = None,
) -> int:
    """Process `windows` in order, preparing each (computing it and writing every sink's
    staged copy, on Spark) while the one before it commits; return how many.

    A window is prepared only after the window before it has staged its dedupe keys, and
    its lookups read those staged keys too, so it is deduplicated against every earlier
    window even before that window's commit has put them into the key index. Nothing of a
    window is committed before the windows before it are completed. After each window,
    it stops when `stop` is set or `limit` windows are done.
    """
    # The ledger's sessions are reused from window to window and closed at the end.
    with ctx.ledger.sessions.kept():
        return _process(ctx, windows, epoch, run_id, done, stop=stop, limit=limit)


def _process(
    ctx: JobContext,
    windows: Iterator[Window],
    epoch: int,
    run_id: str,
    done: Callable[[WindowResult], None],
    *,
    stop: threading.Event | None,
    limit: int | None,
) -> int:
    count = 0
    window = next(windows, None) if limit is None or limit > 0 else None
    if window is None:
        return count
    ahead: Prepared | None = prepare(ctx, window, epoch, run_id)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="onceflow-prepare") as pool:
        while ahead is not None:
            # The windows before it are completed now: what its dedupe saw must be them.
            current = fresh(ctx, ahead)
            last = (stop is not None and stop.is_set()) or (
                limit is not None and count + 1 >= limit
            )
            following = None if last else next(windows, None)
            pending: Future[Prepared] | None = None
            if following is not None and (current.keys is not None or ctx.index is None):
                pending = pool.submit(prepare, ctx, following, epoch, run_id, current)
            try:
                done(commit(ctx, current, keep_keys=pending is not None))
            except BaseException:
                if pending is not None and not pending.cancel():
                    with contextlib.suppress(BaseException):
                        discard(ctx, pending.result())
                drop_keys(ctx, current)
                raise
            finally:
                count += 1
            if pending is not None:
                try:
                    ahead = pending.result()
                finally:
                    drop_keys(ctx, current)
            elif following is not None:
                ahead = prepare(ctx, following, epoch, run_id)
            else:
                ahead = None
    return count
