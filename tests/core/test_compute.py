"""The compute's first-occurrence rule when a window is read by several tasks, each in source
order: the key lookup marks the repeats within each task's share, and only the keys several
tasks kept are compared across them (`_compute._first_across_tasks`). The sinks must hold
what one ordered pass over the window keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from onceflow import _compute
from onceflow.engine import build_engine
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.settings import Settings
from onceflow.sources import landing as landing_module
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact


@pytest.fixture()
def read_in_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every window read by three tasks, however small; the calls of the cross-task step,
    counted."""
    monkeypatch.setattr(landing_module, "ONE_TASK_MAX_BYTES", 1)
    monkeypatch.setattr(landing_module, "_read_cores", lambda spark: 3)
    calls: list[int] = []
    original = _compute._first_across_tasks

    def counted(valid: Any, keys: Any) -> Any:
        calls.append(1)
        return original(valid, keys)

    monkeypatch.setattr(_compute, "_first_across_tasks", counted)
    return calls


def test_a_window_read_by_several_tasks_keeps_each_keys_first_occurrence(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, read_in_runs: list[int]
) -> None:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    # Repeats within files and across them (some with other amounts, merchants, customers: a
    # later occurrence kept instead of the first shows in every sink), then files that repeat
    # only earlier ids, so that most keys of those windows were kept by an earlier task of
    # the same window or by an earlier window.
    generate_payments(landing, records=1200, files=6, duplicate_rate=0.3, invalid_rate=0.05, seed=7)
    generate_payments(landing, records=400, files=3, duplicate_rate=0.2, invalid_rate=0.05, seed=7)
    result = build_engine(PAYMENTS, settings, spark, pg_dsn).run(max_units_per_window=4)
    assert [w.window_id for w in result.windows] == [1, 2, 3]
    assert len(read_in_runs) == 3  # every window read in runs, compared across them
    assert sum(w.stats["duplicates"] for w in result.windows) > 0
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))


def test_a_key_whose_first_occurrence_is_invalid_is_kept_where_it_is_first_valid(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, read_in_runs: list[int]
) -> None:
    """One window of three files, a task each: a key first invalid (quarantined), then valid in
    the second task's file and again in the third's; another valid in every file, its first
    occurrence last in the first file."""
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    folder = landing / "payments"
    folder.mkdir(parents=True, exist_ok=True)

    def line(pid: str, amount: Any, merchant: str = "m1") -> str:
        return (
            f'{{"payment_id": "{pid}", "merchant_id": "{merchant}", "customer_id": "c1", '
            f'"amount_cents": {amount}, "currency": "EUR", '
            f'"created_at": "2026-11-01T10:00:00Z"}}'
        )

    files = {
        "payments-1.jsonl": [line("p-late", "not a number"), line("p-every", 100)],
        "payments-2.jsonl": [line("p-other", 5), line("p-late", 200), line("p-every", 300, "m2")],
        "payments-3.jsonl": [line("p-late", 400, "m3"), line("p-every", 500, "m3")],
    }
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    result = build_engine(PAYMENTS, settings, spark, pg_dsn).run(max_units_per_window=3)
    assert [w.window_id for w in result.windows] == [1]
    assert len(read_in_runs) == 1
    expected = expected_outputs(landing)
    assert expected.payments["p-late"][3] == 200 and expected.payments["p-every"][3] == 100
    assert_exact(expected, actual_outputs(pg_dsn, lake))
