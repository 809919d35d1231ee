"""What an orchestrator in another environment needs of the jobs, without Spark: each sink's
table address (the Dagster assets' `dagster/uri`), the table a job reads when another job
writes it, and each job's pending work (the trigger for its next run).

Airflow's provider (integrations/airflow) runs it across the process boundary:

    python -m onceflow.ops.catalog [JOB ...] [--pending]

prints one JSON object on stdout: `{"ok": true, "jobs": {name: {...}}}`; on a failure
`{"ok": false, "error", "message", "retryable", "exit_code"}` and that exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from onceflow.ops._checks import pending_work
from onceflow.ops._engine import open_engine
from onceflow.ops._exit import exit_code


def job_catalog(name: str, *, pending: bool = False) -> dict[str, Any]:
    """One job's sinks with their table addresses (as `SinkGroup.table_facts` gives them to
    Dagster's `dagster/uri`), the lake table its source reads, and, with `pending`, its
    unplanned input units and pending windows."""
    engine = open_engine(name)
    sinks: dict[str, dict[str, Any]] = {}
    for group in engine.groups:
        for sink in group.names:
            facts = group.table_facts(sink)
            spec = next(s for s in engine.job.sinks if s.name == sink)
            sinks[sink] = {
                "uri": facts.uri if facts is not None else None,
                "lake_table": spec.lake_table,
            }
    out: dict[str, Any] = {"sinks": sinks, "reads_lake_table": engine.job.source.lake_table}
    if pending:
        work = pending_work(engine)
        out["pending"] = {
            "unplanned": work.unplanned,
            "pending_windows": list(work.pending_windows),
            "any": work.any,
        }
    return out


def catalog(names: Sequence[str] = (), *, pending: bool = False) -> dict[str, Any]:
    """`job_catalog` of `names` (default every registered job), each job's upstream sink
    addresses resolved: `inputs` lists the addresses of other jobs' sinks writing the table it
    reads (job, sink, uri), so a downstream orchestrator schedules it on their changes."""
    from onceflow.registry import load_jobs

    registered = load_jobs().jobs
    wanted = list(names) or list(registered)
    jobs = {name: job_catalog(name, pending=pending) for name in wanted}
    writers: dict[str, list[dict[str, str]]] = {}
    for name in registered:
        info = jobs.get(name) or job_catalog(name)
        for sink, facts in info["sinks"].items():
            if facts["lake_table"] is not None and facts["uri"] is not None:
                writers.setdefault(facts["lake_table"], []).append(
                    {"job": name, "sink": sink, "uri": facts["uri"]}
                )
    for info in jobs.values():
        table = info["reads_lake_table"]
        info["inputs"] = writers.get(table, []) if table is not None else []
    return {"operation": "catalog", "ok": True, "jobs": jobs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onceflow.ops.catalog")
    parser.add_argument("jobs", nargs="*", help="jobs to describe (default: all)")
    parser.add_argument("--pending", action="store_true", help="add each job's pending work")
    args = parser.parse_args(argv)
    try:
        result = catalog(args.jobs, pending=args.pending)
    except Exception as exc:  # reported as the commands report a failure
        code = exit_code(exc)
        print(
            json.dumps(
                {
                    "operation": "catalog",
                    "ok": False,
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "retryable": code == 75,
                    "exit_code": code,
                }
            )
        )
        return code
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
