"""Run in the project's venv (the oracle is onceflow's): how far the sinks of `payments` or
`daily_totals` are from the oracle over the landing files, as one JSON line on stdout:
`{output: {"lost": n, "doubled": n, "other": n}}`.

    .venv/bin/python integrations/airflow/tests/exact.py payments|daily_totals
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from onceflow.ops import release_embedded, resolve_dsn
from onceflow.settings import Settings
from tests.support.daily_totals_oracle import actual_totals, diff_totals, totals_from_landing
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, diff_outputs


def main(job: str) -> dict[str, dict[str, int]]:
    settings = Settings.from_env()
    dsn = resolve_dsn(settings.postgres_dsn, settings.home)
    landing = Path(os.environ["ONCEFLOW_LANDING"])
    if job == "daily_totals":
        d = diff_totals(totals_from_landing(landing), actual_totals(dsn))
        return {"daily_totals": {"lost": d.lost, "doubled": d.doubled, "other": d.changed_keys}}
    lake = Path(os.environ["ONCEFLOW_LAKE"])
    diffs = diff_outputs(expected_outputs(landing), actual_outputs(dsn, lake))
    return {
        name: {"lost": d.lost, "doubled": d.doubled, "other": d.extra + d.changed}
        for name, d in diffs.items()
    }


if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1])))
    finally:
        release_embedded()
