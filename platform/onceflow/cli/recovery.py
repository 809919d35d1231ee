"""The commands that look at and repair a job's state: recover, reconcile, status, validate."""

from __future__ import annotations

import argparse
import json
from typing import Any

from onceflow import ops
from onceflow.cli._present import add_json, add_run_id, emit, engine_for
from onceflow.ops import (
    EXIT_CHECKS_FAILED,
    EXIT_OK,
    Progress,
    format_report,
    format_windows,
)


def cmd_recover(args: argparse.Namespace) -> int:
    engine = engine_for(args.job)
    with Progress(f"recover {args.job}", unit="steps") as progress:
        result = ops.recover(
            engine,
            run_id=args.run_id,
            verify_last=args.verify_last,
            reconcile=args.reconcile,
            dry_run=args.dry_run,
            on_step=progress.phase,
        )
    code = EXIT_OK if result.ok else EXIT_CHECKS_FAILED
    if args.json:
        emit(result)
        return code
    for sink, ids in result.restored.items():
        print(f"{sink} had lost committed windows {format_windows(ids)}; replayed")
    replayed = [w.window_id for w in result.replayed if not w.noop]
    print(
        f"recover {result.run_id}: {len(replayed)} window(s) replayed "
        f"({format_windows(replayed) or 'none'}); {len(result.verified)} verified, "
        f"{len(result.incomplete)} incomplete"
    )
    for wid, sinks in result.incomplete.items():
        print(f"window {wid}: not held by {', '.join(sinks)}")
    if result.reconcile is not None:
        print(format_report(result.reconcile))
    return code


def cmd_status(args: argparse.Namespace) -> int:
    engine = engine_for(args.job, spark=False)
    result = ops.status(engine)
    if args.json:
        emit(result)
    else:
        print(ops.format_status(result.status))
    return EXIT_OK


def cmd_reconcile(args: argparse.Namespace) -> int:
    engine = engine_for(args.job)
    with Progress(f"reconcile {args.job}", total=len(engine.job.sinks), unit="sinks") as progress:

        def on_step(text: str) -> None:
            if text.startswith("comparing") and progress.current.startswith("comparing"):
                progress.advance()
            progress.phase(text)

        report = ops.reconcile(
            engine,
            dry_run=args.dry_run,
            mode="incremental" if args.incremental else "full",
            on_step=on_step,
        )
    if args.json:
        print(json.dumps(report.as_json(), indent=2, default=str))
    else:
        print(format_report(report))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    engine = engine_for(args.job)
    with Progress(f"validate {args.job}", unit="sinks") as progress:
        progress.phase(f"checking {', '.join(s.name for s in engine.job.sinks)}")
        done = ops.validate(engine)
    report = done.report
    if args.json:
        emit(done)
        return EXIT_OK if report.passed else EXIT_CHECKS_FAILED
    for result in report.results:
        mark = "ok  " if result.passed else "FAIL"
        print(f"{mark} {result.sink}: {result.check} {result.observed}")
    if report.data_docs:
        print(f"data docs: {report.data_docs}")
    return 0 if report.passed else EXIT_CHECKS_FAILED


def add_recover(sub: Any) -> None:
    rcv = sub.add_parser(
        "recover",
        help="put back lost windows, replay pending ones, verify every sink, reconcile",
    )
    rcv.add_argument("job")
    rcv.add_argument(
        "--verify-last",
        type=int,
        default=ops.VERIFY_LAST,
        help=f"verify the last N windows (0: every window; default {ops.VERIFY_LAST})",
    )
    rcv.add_argument("--reconcile", choices=["incremental", "full", "off"], default="incremental")
    rcv.add_argument("--dry-run", action="store_true", help="reconcile reports, repairs nothing")
    add_run_id(rcv)
    add_json(rcv)
    rcv.set_defaults(func=cmd_recover)


def add_status(sub: Any) -> None:
    status = sub.add_parser("status", help="windows, offsets, per-sink commit state, lag")
    status.add_argument("job")
    add_json(status)
    status.set_defaults(func=cmd_status)


def add_reconcile(sub: Any) -> None:
    rec = sub.add_parser("reconcile", help="diff every sink against the expected state, repair")
    rec.add_argument("job")
    rec.add_argument("--dry-run", action="store_true")
    rec.add_argument("--incremental", action="store_true")
    add_json(rec)
    rec.set_defaults(func=cmd_reconcile)


def add_validate(sub: Any) -> None:
    val = sub.add_parser("validate", help="run the Great Expectations suites")
    val.add_argument("job")
    add_json(val)
    val.set_defaults(func=cmd_validate)
