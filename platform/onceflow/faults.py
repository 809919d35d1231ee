"""Named fault points for crash tests: `ONCEFLOW_FAULT=point[@window][:action]`.

With no `ONCEFLOW_FAULT` set, `point` is a dictionary lookup and nothing else. The actions are
real signals sent by the process to itself: `kill` (SIGKILL, the default) and `stop` (SIGSTOP:
the process freezes until someone sends SIGCONT, a zombie run).
"""

from __future__ import annotations

import os
import signal
import sys

from onceflow.errors import ConfigurationError

POINTS = (
    "plan",  # inside the ledger transaction that plans a window, before its COMMIT
    "before_sinks",  # window planned and its output staged, before any sink write
    "after_delta",  # after the Delta sinks committed, before the next kind of sink
    "after_postgres",  # after the PostgreSQL sinks committed, before the next kind of sink
    "keys_staging",  # a window's key staging table created, its keys not yet copied
    "pg_staged",  # executors filled the PostgreSQL staging tables, the apply not yet begun
    "before_pg_commit",  # PostgreSQL transaction ready, COMMIT not yet sent
    "pg_commit_sent",  # COMMIT sent to PostgreSQL, its answer not read
    "after_commits",  # every sink committed, ledger not yet told
    "restated",  # a window restated in every sink, the ledger not yet told
    "repair_staged",  # reconcile copied a sink's repair rows into staging, not yet applied
    "prune_locked",  # maintenance holds the job's row, its detail horizon read, nothing dropped
)
ACTIONS = ("kill", "stop")


def _parse(spec: str) -> tuple[str, int | None, str]:
    action = "kill"
    if ":" in spec:
        spec, action = spec.split(":", 1)
    window: int | None = None
    if "@" in spec:
        spec, at = spec.split("@", 1)
        window = int(at)
    if spec not in POINTS or action not in ACTIONS:
        raise ConfigurationError(
            f"ONCEFLOW_FAULT={os.environ.get('ONCEFLOW_FAULT')!r}: use point[@window][:action] "
            f"with a point of {list(POINTS)} and an action of {list(ACTIONS)}."
        )
    return spec, window, action


def armed(name: str, window_id: int | None = None) -> bool:
    """True when the fault `name` is configured for this window."""
    spec = os.environ.get("ONCEFLOW_FAULT")
    if not spec:
        return False
    want, window, _ = _parse(spec)
    return want == name and (window is None or window == window_id)


def point(name: str, window_id: int | None = None) -> None:
    """Fire the configured fault if this is its point (and window)."""
    if not armed(name, window_id):
        return
    _, _, action = _parse(os.environ["ONCEFLOW_FAULT"])
    sys.stderr.write(f"onceflow: fault injected at {name} (window {window_id}): {action}\n")
    sys.stderr.flush()
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        # Resumed: only once, so the woken run goes on as a zombie would.
        os.environ.pop("ONCEFLOW_FAULT", None)
        return
    os.kill(os.getpid(), signal.SIGKILL)
