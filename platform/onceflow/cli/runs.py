"""The commands that commit windows: run, backfill and restate (with its --cancel)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from onceflow import ConfigurationError, ops
from onceflow.cli._present import (
    add_json,
    add_run_id,
    echo_to,
    emit,
    engine_for,
    window_line,
    windows_ahead,
)
from onceflow.ops import EXIT_OK, Progress, parse_windows


def cmd_run(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, args.guarantee, check_input=True)
    stop = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        print("onceflow: stopping after the current window", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    if args.follow:
        signal.signal(signal.SIGINT, on_term)
    progress = Progress(f"run {args.job}")
    if progress.enabled and not args.follow:  # the estimate costs a listing: only to draw it
        progress.total = windows_ahead(engine, args.max_files_per_window)
    with progress:

        def on_window(window: Any) -> None:
            progress.advance(1, int((window.stats or {}).get("rows_in", 0)))
            progress.echo(window_line(window), echo_to(args))

        result = ops.run(
            engine,
            run_id=args.run_id,
            max_units_per_window=args.max_files_per_window,
            follow=args.follow,
            poll_interval_s=args.poll_interval,
            stop=stop,
            on_window=on_window,
        )
    if args.json:
        emit(result)
    else:
        print(f"run {result.run_id} (epoch {result.epoch}): {len(result.windows)} window(s)")
    return EXIT_OK


def cmd_backfill(args: argparse.Namespace) -> int:
    engine = engine_for(args.job)
    result = ops.backfill(engine, parse_windows(args.windows), run_id=args.run_id)
    if args.json:
        emit(result)
        return EXIT_OK
    for wid in result.noop_windows:
        print(f"window {wid}: already committed in every sink; nothing changed")
    for note in result.notes:
        print(note)
    for window in result.committed:
        sinks = ", ".join(f"{s.sink}={s.rows}" for s in window.sinks if s.committed)
        print(f"window {window.window_id}: backfilled ({sinks})")
    return EXIT_OK


def cmd_restate(args: argparse.Namespace) -> int:
    if args.cancel is not None:
        return _cancel_restatement(args)
    if args.windows is None and not args.source_replaced:
        raise ConfigurationError("name the windows to restate (--windows 3-7).")
    ids = parse_windows(args.windows) if args.windows is not None else []
    engine = engine_for(args.job)
    done = ops.restate(
        engine,
        ids,
        run_id=args.run_id,
        request_id=args.request_id,
        source_replaced=args.source_replaced,
    )
    if args.json:
        emit(done)
        return EXIT_OK
    if args.source_replaced and not done.windows:
        print("no window's input was replaced; nothing was restated")
    for result in done.windows:
        if result.noop:
            print(f"window {result.window_id}: this request already restated it; nothing changed")
            continue
        sinks = ", ".join(f"{s.sink}={s.rows}" for s in result.sinks)
        print(f"window {result.window_id}: restated in every sink ({sinks})")
    return EXIT_OK


def _cancel_restatement(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, spark=False)
    done = ops.cancel_restatement(engine, args.cancel, args.reason or "", run_id=args.run_id)
    if args.json:
        emit(done)
        return EXIT_OK
    for item in done.cancelled:
        print(
            f"window {item.window_id}: restatement cancelled (seq {item.seq}, request "
            f"{done.request}): {item.cancelled}"
        )
    for item in done.finished:
        print(f"window {item.window_id}: already restated in every sink; it stays so")
    print(
        f"The cancelled windows keep the rows they have; `onceflow run {args.job}` goes on "
        "without them, and `onceflow status` lists them."
    )
    return 0


def add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="process everything visible, commit it to every sink")
    run.add_argument("job")
    run.add_argument(
        "--max-files-per-window",
        type=int,
        default=None,
        help="most files (or, for a Delta table source, table versions) a new window takes",
    )
    run.add_argument(
        "--follow", action="store_true", help="keep committing new files until SIGTERM"
    )
    run.add_argument("--poll-interval", type=float, default=1.0)
    run.add_argument("--guarantee", choices=["exactly_once", "at_least_once", "none"], default=None)
    add_run_id(run)
    add_json(run)
    run.set_defaults(func=cmd_run)


def add_backfill(sub: Any) -> None:
    bf = sub.add_parser("backfill", help="bring chosen past windows into every sink")
    bf.add_argument("job")
    bf.add_argument("--windows", required=True, help="window ids, e.g. 3-7 or 3,5,9-10")
    add_run_id(bf)
    add_json(bf)
    bf.set_defaults(func=cmd_backfill)


def add_restate(sub: Any) -> None:
    res = sub.add_parser("restate", help="replace chosen windows' effect in every sink")
    res.add_argument("job")
    res.add_argument("--windows", default=None, help="window ids, e.g. 3-7 or 3,5,9-10")
    res.add_argument(
        "--source-replaced",
        action="store_true",
        help="the source's input was replaced (an upstream Delta table recreated or restored): "
        "restate every window (of --windows, default all) whose input changed, from the input "
        "as it is now",
    )
    res.add_argument(
        "--cancel",
        metavar="REQUEST",
        default=None,
        help="give up the unfinished restatements of REQUEST (as `onceflow status` lists it)",
    )
    res.add_argument(
        "--request-id",
        default=None,
        help="name the request so that running it again restates each window once",
    )
    res.add_argument("--reason", default=None, help="with --cancel: why; shown in status")
    add_run_id(res)
    add_json(res)
    res.set_defaults(func=cmd_restate)
