"""`onceflow windows abandon`: a completed window that a sink lost and whose input is gone is
given up for that sink, recorded with its reason; runs go on, and status, reconcile and the
quality suites name the gap. Everything else stays exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onceflow.engine import Engine
from onceflow.errors import LedgerError
from onceflow.generate import generate_payments
from onceflow.lineage import lineage
from onceflow.reconcile import format_report, reconcile
from onceflow.registry import get_job
from onceflow.settings import Settings
from onceflow.status import open_items
from onceflow.validation import validate_job
from tests.support.cli import CliRun, Finished, cli_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, diff_outputs

pytestmark = pytest.mark.slow

REASON = "file lost upstream"


class Site:
    def __init__(self, spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path) -> None:
        self.spark, self.dsn, self.tmp = spark, pg_dsn, tmp_path
        self.settings = Settings(
            home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing
        )
        self.source = tmp_path / "input"
        generate_payments(
            self.source, records=1600, files=8, duplicate_rate=0.25, invalid_rate=0.05, seed=5
        )
        self.files = sorted((self.source / "payments").iterdir())
        (landing / "payments").mkdir(parents=True, exist_ok=True)

    def engine(self) -> Engine:
        return Engine(get_job("payments"), self.settings, self.spark, self.dsn)

    def land(self, *indexes: int) -> None:
        for i in indexes:
            shutil.copy2(
                self.files[i], self.settings.landing.path / "payments" / self.files[i].name
            )

    def unland(self, index: int) -> None:
        (self.settings.landing.path / "payments" / self.files[index].name).unlink()

    def cli(self, *args: str) -> Finished:
        env = cli_env(
            home=self.settings.home,
            dsn=self.dsn,
            lake=self.settings.lake.path,
            landing=self.settings.landing.path,
        )
        return CliRun(list(args), env, self.tmp / "logs").finish()


def test_a_lost_window_is_abandoned_for_the_sink_and_named_everywhere(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    site = Site(spark, pg_dsn, tmp_path, lake, landing)
    site.land(0, 1, 2, 3, 4, 5)
    assert [w.window_id for w in site.engine().run(max_units_per_window=2).windows] == [1, 2, 3]

    # The lake's table is deleted, and so is one input file of window 2.
    shutil.rmtree(lake / "payments")
    site.unland(2)
    site.land(6, 7)

    with pytest.raises(LedgerError) as refused:
        site.engine().run(max_units_per_window=2)
    assert "lake_payments lacks windows 1-3" in refused.value.message
    assert "onceflow reconcile payments" in refused.value.message
    assert "onceflow windows abandon payments 2" in refused.value.message

    # Reconcile replays window 1, and stops at window 2 in the lake: window 3 on top of the gap
    # would hide it.
    first = reconcile(site.engine())
    assert first.replayed == {"lake_payments": [1]}
    assert first.lacking == {"lake_payments": [2, 3]}
    assert first.gone == [2]
    assert not first.clean
    text = format_report(first)
    assert "onceflow windows abandon payments 2" in text, text
    with pytest.raises(LedgerError):
        site.engine().run(max_units_per_window=2)

    # What abandon refuses, before it records anything.
    no_reason = site.cli("windows", "abandon", "payments", "2", "--reason", " ")
    assert no_reason.returncode != 0 and "--reason" in no_reason.stderr
    readable = site.cli("windows", "abandon", "payments", "2-3", "--reason", REASON)
    assert readable.returncode != 0
    assert "window 3's input is still readable" in readable.stderr
    assert "onceflow reconcile payments" in readable.stderr
    held = site.cli("windows", "abandon", "payments", "1", "--reason", REASON)
    assert held.returncode != 0 and "every sink holds window 1" in held.stderr
    assert site.engine().ledger.abandoned() == {}

    done = site.cli("windows", "abandon", "payments", "2", "--reason", REASON)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"window 2 of payments abandoned for lake_payments: {REASON}" in done.stdout
    assert "lake_payments still lacks windows 3" in done.stdout
    assert site.engine().ledger.abandoned() == {"lake_payments": {2}}
    assert site.engine().ledger.abandoned_reasons() == [(2, "lake_payments", REASON)]
    again = site.cli("windows", "abandon", "payments", "2", "--reason", REASON)
    assert again.returncode == 0 and "nothing changed" in again.stdout

    second = reconcile(site.engine())
    assert second.replayed == {"lake_payments": [3]}
    assert second.lacking == {}
    assert second.abandoned == [(2, "lake_payments", REASON)]
    # Nothing differs; window 2 stays unverifiable (its input is gone), so the accumulating
    # sink, whose rows carry no window, is not compared.
    assert all(s.missing == s.extra == s.changed == 0 for s in second.sinks), second
    assert [w for w, _ in second.unverifiable] == [2]
    assert f"window 2: abandoned for lake_payments by an operator ({REASON})" in format_report(
        second
    )

    # Runs go on with new input.
    after = site.engine().run(max_units_per_window=2)
    assert [w.window_id for w in after.windows] == [4]
    engine = site.engine()
    assert engine.lacking_windows() == {}
    assert engine.incomplete_windows(engine.ledger.windows()) == {}

    # Exact but for the gap: PostgreSQL holds every record (of all 8 files, the lost one's
    # too); the lake holds the same payments but window 2's.
    actual = actual_outputs(pg_dsn, lake)
    diffs = diff_outputs(expected_outputs(site.source), actual)
    for name in ("pg payments", "merchant_balances", "quarantine"):
        assert diffs[name].exact, (name, diffs[name])
    gap = [row for row in actual.pg_payments if row[6] == 2]
    assert gap
    assert sorted(actual.delta_payments) == sorted(r for r in actual.pg_payments if r[6] != 2)

    # Named, never silent: status (text and JSON), open items, the quality suites.
    status = site.cli("status", "payments")
    assert status.returncode == 0, status.stderr[-2000:]
    assert f"window 2 abandoned for lake_payments: {REASON}" in status.stdout
    as_json = json.loads(site.cli("status", "payments", "--json").stdout)
    assert as_json["abandoned"] == [{"window_id": 2, "sink": "lake_payments", "reason": REASON}]
    assert open_items(engine).abandoned == ((2, "lake_payments", REASON),)
    report = validate_job(engine)
    assert report.passed, [(r.sink, r.check, r.observed) for r in report.failures()]
    named = [r for r in report.results if r.check == "abandoned_windows"]
    assert [(r.sink, r.observed["windows"]) for r in named] == [("lake_payments", "2")]
    lake_rows = next(
        r for r in report.results if r.sink == "lake_payments" and r.check == "row_count"
    )
    assert lake_rows.observed["abandoned_rows"] == len(gap)

    # The sink assets' metadata (what the Dagster UI shows).
    from assets.catalog import lineage_table
    from assets.runs import open_items_metadata

    metadata = open_items_metadata(engine)
    assert metadata["windows_abandoned"].value == 1
    assert metadata["abandoned"].value == {"lake_payments": {"2": REASON}}
    rows = lineage(pg_dsn, "payments")
    table = lineage_table(rows, engine.job.sink("lake_payments"), {2: REASON})
    states = {r.data["window"]: r.data["state"] for r in table.value.records}
    assert states[2] == f"abandoned here (a known gap): {REASON}"
    assert states[3] == "completed"


def test_a_pending_window_is_skipped_not_abandoned(
    spark, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    site = Site(spark, pg_dsn, tmp_path, lake, landing)
    site.land(0, 1)
    engine = site.engine()
    epoch = engine.start("plan-only")
    window = engine.ledger.plan_window(epoch, engine.job.source.offsets(site.settings, []), [])
    refused = site.cli("windows", "abandon", "payments", str(window.window_id), "--reason", "x")
    assert refused.returncode != 0
    assert "onceflow windows skip payments" in refused.stderr
