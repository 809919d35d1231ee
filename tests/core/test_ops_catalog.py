"""`python -m onceflow.ops.catalog`, what Airflow's provider reads across the process boundary:
each sink's address as Dagster's `dagster/uri` shows it, the sinks writing the table a job
reads, and the pending work, without Spark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onceflow.generate import generate_payments
from onceflow.ops import catalog as catalog_module
from onceflow.ops import open_engine


def test_catalog_names_the_sinks_inputs_and_pending_work(
    pg_dsn: str,
    tmp_path: Path,
    lake: Path,
    landing: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in {
        "ONCEFLOW_HOME": tmp_path / "home",
        "ONCEFLOW_POSTGRES_DSN": pg_dsn,
        "ONCEFLOW_LAKE": lake,
        "ONCEFLOW_LANDING": landing,
    }.items():
        monkeypatch.setenv(key, str(value))
    generate_payments(landing, records=60, files=3)

    assert catalog_module.main(["--pending"]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]

    payments = jobs["payments"]
    engine = open_engine("payments")
    facts = {n: g.table_facts(n) for g in engine.groups for n in g.names}
    # The addresses the Dagster assets show as `dagster/uri`.
    assert {n: s["uri"] for n, s in payments["sinks"].items()} == {
        n: f.uri for n, f in facts.items() if f is not None
    }
    assert payments["sinks"]["lake_payments"]["uri"] == (lake / "payments").as_uri()
    assert payments["pending"] == {"unplanned": 3, "pending_windows": [], "any": True}
    # daily_totals reads the payments table: its input is that sink's address.
    assert jobs["daily_totals"]["inputs"] == [
        {"job": "payments", "sink": "lake_payments", "uri": (lake / "payments").as_uri()}
    ]

    assert catalog_module.main(["no_such_job"]) == 1
    failure = json.loads(capsys.readouterr().out)
    assert failure["ok"] is False and "no_such_job" in failure["message"]
