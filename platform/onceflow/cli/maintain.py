"""`onceflow maintain JOB`: compact, checkpoint and vacuum a job's Delta sinks past its horizon."""

from __future__ import annotations

import argparse
from typing import Any

from onceflow import ops
from onceflow.cli._present import add_json, add_run_id, emit, engine_for
from onceflow.ops import EXIT_OK


def cmd_maintain(args: argparse.Namespace) -> int:
    result = ops.maintain(
        engine_for(args.job, spark=False),
        dry_run=args.dry_run,
        orphan_age_s=args.orphan_age_s,
        run_id=args.run_id,
    )
    if args.json:
        emit(result)
    else:
        print("\n".join(result.lines()))
    return EXIT_OK


def add_maintain(sub: Any) -> None:
    mnt = sub.add_parser(
        "maintain",
        help="compact, checkpoint, vacuum the job's Delta sinks past what readers still need",
    )
    mnt.add_argument("job")
    mnt.add_argument("--dry-run", action="store_true", help="report; change nothing")
    mnt.add_argument(
        "--orphan-age-s",
        type=float,
        default=None,
        help="remove files no commit names once older than this (default 3600), under a fence",
    )
    add_run_id(mnt)
    add_json(mnt)
    mnt.set_defaults(func=cmd_maintain)
