"""The `onceflow` command line: it presents the operations of `onceflow.ops` (run, backfill,
restate, recover, skip, reconcile, validate, status) and the tools (jobs, generate, demo, servers).

`--json` prints one JSON object on stdout (logs and progress stay on stderr); the exit codes are
`onceflow.ops`' (EXIT_*), documented in the README.

A module per group of commands (`runs`, `recovery`, `windows`, `tools`), each with its commands'
`cmd_*` and the `add_*` that declares them; `_parser` assembles them, `_main` runs one,
`_present` and `_failure` hold what the commands share for showing a result or a failure.
"""

from __future__ import annotations

from onceflow.cli._main import main
from onceflow.cli._parser import build_parser

__all__ = ["build_parser", "main"]
