"""`onceflow maintain JOB`: compact, checkpoint and vacuum a job's Delta sinks past its horizon,
and drop the ledger's per-window detail past the job's detail horizon."""

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
        keep_detail_days=args.keep_detail_days,
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
        help="compact, checkpoint, vacuum the job's Delta sinks past what readers still need; "
        "drop the ledger's old per-window detail",
    )
    mnt.add_argument("job")
    mnt.add_argument("--dry-run", action="store_true", help="report; change nothing")
    mnt.add_argument(
        "--orphan-age-s",
        type=float,
        default=None,
        help="remove files no commit names once older than this (default 3600), under a fence",
    )
    mnt.add_argument(
        "--keep-detail-days",
        type=float,
        default=None,
        help="windows planned within this many days keep the ledger's lineage rows and "
        "contributions, so they can be restated (default 30)",
    )
    add_run_id(mnt)
    add_json(mnt)
    mnt.set_defaults(func=cmd_maintain)
