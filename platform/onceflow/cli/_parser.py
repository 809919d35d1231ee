"""The command line's parser, assembled from the commands' modules."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from onceflow.cli import maintain, recovery, runs, tools, windows

# Each command's `add_*` adds its subparser and sets `func`; the order here is `--help`'s order.
# A new command is a function in the module of its group (or a module of its own) and a line here.
COMMANDS: tuple[Callable[[Any], None], ...] = (
    runs.add_run,
    runs.add_backfill,
    recovery.add_recover,
    recovery.add_status,
    maintain.add_maintain,
    recovery.add_reconcile,
    runs.add_restate,
    windows.add_windows,
    tools.add_jobs,
    recovery.add_validate,
    tools.add_generate,
    tools.add_spark_server,
    tools.add_spark_cluster,
    tools.add_s3_server,
    tools.add_demo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onceflow", description="Exactly-once Spark jobs into Delta Lake and PostgreSQL."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser
