"""`onceflow windows …`: the operator's actions on a job's windows (skip, recompute, abandon)."""

from __future__ import annotations

import argparse
from typing import Any

from onceflow import ops
from onceflow.cli._present import add_json, add_run_id, emit, engine_for
from onceflow.ops import EXIT_OK, format_windows, parse_windows


def cmd_windows_skip(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, spark=False)
    skipped = ops.skip(engine, parse_windows(args.windows), args.reason, run_id=args.run_id)
    if args.json:
        emit(skipped)
        return EXIT_OK
    print(
        f"windows {format_windows(list(skipped.windows))} of {args.job} skipped: "
        f"{skipped.reason}. They stay listed in `onceflow status` and reconcile reports; "
        "their input stays taken."
    )
    return 0


def cmd_windows_recompute(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, spark=False)
    done = ops.recompute(engine, parse_windows(args.windows), run_id=args.run_id)
    if args.json:
        emit(done)
        return EXIT_OK
    if done.deterministic:
        print(
            f"job {args.job} is deterministic: it keeps no stage, and its pending windows "
            f"{args.windows} are computed with its current code by `onceflow run {args.job}`."
        )
        return 0
    print(
        f"windows {format_windows(list(done.windows))} of {args.job}: the outputs staged by an earlier "
        f"run dropped; `onceflow run {args.job}` computes them again with the job's current "
        "code, from the same input."
    )
    if done.later:
        print(
            f"windows {format_windows(list(done.later))} are computed again with them (their dedupe "
            "looked up the keys of those windows)."
        )
    return 0


def cmd_windows_abandon(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, spark=False)
    done = ops.abandon(engine, parse_windows(args.windows), args.reason, run_id=args.run_id)
    if args.json:
        emit(done)
        return EXIT_OK
    if not done.windows:
        print(f"windows {args.windows} of {args.job} were abandoned before; nothing changed.")
    for wid, sinks in done.windows.items():
        print(
            f"window {wid} of {args.job} abandoned for {', '.join(sinks)}: {args.reason.strip()}."
            " A known gap: `onceflow status`, reconcile, validate and the asset metadata name it."
        )
    for sink, ids in done.lacking.items():
        print(
            f"{sink} still lacks windows {format_windows(list(ids))}: run `onceflow reconcile "
            f"{args.job}` to replay them."
        )
    return 0


def add_windows(sub: Any) -> None:
    win = sub.add_parser("windows", help="operator actions on a job's windows")
    win_sub = win.add_subparsers(dest="action", required=True)
    skip = win_sub.add_parser(
        "skip",
        help="give up pending windows whose input is gone or changed (recorded with a reason)",
    )
    skip.add_argument("job")
    skip.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    skip.add_argument("--reason", required=True, help="why; shown in status and reconcile")
    add_run_id(skip)
    add_json(skip)
    skip.set_defaults(func=cmd_windows_skip)
    recompute = win_sub.add_parser(
        "recompute",
        help="compute pending windows no sink holds again with the job's current code",
    )
    recompute.add_argument("job")
    recompute.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    add_run_id(recompute)
    add_json(recompute)
    recompute.set_defaults(func=cmd_windows_recompute)
    abandon = win_sub.add_parser(
        "abandon",
        help="give up completed windows a sink lacks and whose input is gone (a recorded gap)",
    )
    abandon.add_argument("job")
    abandon.add_argument("windows", help="window ids, e.g. 7 or 7-9")
    abandon.add_argument(
        "--reason", required=True, help="why; shown in status, reconcile and validate"
    )
    add_run_id(abandon)
    add_json(abandon)
    abandon.set_defaults(func=cmd_windows_abandon)
