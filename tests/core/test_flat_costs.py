"""Costs flat in window count: start-up, `status` and the lacking-windows check read what lies
above the last verified point, never every window or the whole Delta log, and still catch a
lost ledger row, a table restored from an older copy and a lost unit index.

The history is written directly (as `benchmarks/maintain_bench.py` does: ledger rows by
`generate_series`, one Delta log entry per window), so no Spark is needed. What is counted is
work, not time: the ledger's full window list (`Ledger.windows`) is never read, and the Delta
log entries read by start-up are the ones above the ledger's whole prefix.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from onceflow import Settings, ops
from onceflow.engine import Engine
from onceflow.ledger import Ledger
from onceflow.sinks.delta.table import DeltaTableSink

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from maintain_bench import JOB, build_history

WINDOWS = 40


@pytest.fixture()
def history(tmp_path: Path, pg_dsn: str) -> tuple[Settings, Engine]:
    settings = Settings(
        home=tmp_path / "home", postgres_dsn=None, lake=tmp_path / "lake", landing=tmp_path / "in"
    )
    settings.check_folders()
    build_history(settings, pg_dsn, WINDOWS)
    return settings, Engine(JOB, settings, None, pg_dsn)


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the reads that grow with the history: every window from the ledger, the
    whole Delta history, and log entries read by name."""
    counts = {"ledger_windows": 0, "delta_history": 0, "log_entries": 0, "lowest_entry": -1}
    windows, history, entry = Ledger.windows, DeltaTable.history, DeltaTableSink.entry_actions

    def all_windows(self: Ledger, **kw: Any) -> Any:
        counts["ledger_windows"] += 1
        return windows(self, **kw)

    def whole_history(self: DeltaTable, *args: Any, **kw: Any) -> Any:
        counts["delta_history"] += 1
        return history(self, *args, **kw)

    def by_name(self: DeltaTableSink, version: int) -> Any:
        if version > 0:  # entry 0 is read by name to tell that the table exists
            counts["log_entries"] += 1
            low = counts["lowest_entry"]
            counts["lowest_entry"] = version if low < 0 else min(low, version)
        return entry(self, version)

    monkeypatch.setattr(Ledger, "windows", all_windows)
    monkeypatch.setattr(DeltaTable, "history", whole_history)
    monkeypatch.setattr(DeltaTableSink, "entry_actions", by_name)
    return counts


def _reset(counts: dict[str, int]) -> None:
    for k in counts:
        counts[k] = -1 if k == "lowest_entry" else 0


def test_startup_status_and_lacking_check_read_nothing_of_a_whole_history(
    history: tuple[Settings, Engine], counted: dict[str, int], pg_dsn: str
) -> None:
    settings, engine = history
    engine.start(f"t-{uuid.uuid4().hex}")
    assert engine.lacking_windows() == {}
    status = ops.status(JOB, settings, dsn=pg_dsn).status
    assert (status["windows"], status["last_window"], status["pending"]) == (WINDOWS, WINDOWS, [])
    assert [w["window_id"] for w in status["recent"]] == list(range(WINDOWS - 9, WINDOWS + 1))
    assert counted == {
        "ledger_windows": 0,
        "delta_history": 0,
        "log_entries": 0,
        "lowest_entry": -1,
    }


def test_lost_ledger_rows_are_rebuilt_from_the_entries_above_the_whole_prefix(
    history: tuple[Settings, Engine], counted: dict[str, int], pg_dsn: str
) -> None:
    _, engine = history
    before = {w.window_id: w.offsets for w in Ledger(pg_dsn, JOB.name).windows()}
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "DELETE FROM onceflow.windows WHERE job = %s AND window_id IN (31, 35, 36)",
            (JOB.name,),
        )
        conn.execute("DELETE FROM onceflow.source_units WHERE job = %s", (JOB.name,))
    _reset(counted)
    engine.start(f"t-{uuid.uuid4().hex}")
    # Window w's commit is log entry w: read newest first down to window 30's, none below.
    assert counted["delta_history"] == 0
    assert counted["lowest_entry"] == 30
    after = {w.window_id: w.offsets for w in Ledger(pg_dsn, JOB.name).windows()}
    assert after == before
    with psycopg.connect(pg_dsn) as conn:
        units = conn.execute(
            "SELECT count(*) FROM onceflow.source_units WHERE job = %s", (JOB.name,)
        ).fetchone()
    assert units == (WINDOWS,)  # the unit index lost on its own is rebuilt whole


def test_a_table_restored_from_an_older_copy_is_still_lacking_windows(
    history: tuple[Settings, Engine], counted: dict[str, int], pg_dsn: str, tmp_path: Path
) -> None:
    settings, engine = history
    path = settings.lake.path / "events"
    log = path / "_delta_log"
    # An older copy: the log as it stood at window 25 (its checkpoint goes with the newer log).
    for entry in log.iterdir():
        if entry.name.startswith("_last_checkpoint") or ".checkpoint." in entry.name:
            entry.unlink()
        elif entry.suffix == ".json" and int(entry.stem) > 25:
            entry.unlink()
    _reset(counted)
    assert engine.lacking_windows() == {"bench_events_lake": list(range(26, WINDOWS + 1))}
    status = ops.status(JOB, settings, dsn=pg_dsn).status
    assert status["sinks"]["bench_events_lake"]["committed_through"] == 25
    assert counted["ledger_windows"] == 0
    shutil.rmtree(path)
    assert engine.lacking_windows() == {"bench_events_lake": list(range(1, WINDOWS + 1))}


def _units(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT window_id, count(*) FROM onceflow.source_units WHERE job = %s"
            " GROUP BY window_id",
            (JOB.name,),
        ).fetchall()
    return {int(w): int(n) for w, n in rows}


def _verified(dsn: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT through FROM onceflow.ledger_verified WHERE job = %s", (JOB.name,)
        ).fetchone()
    return None if row is None else int(row[0])


@pytest.mark.parametrize(
    "damage",
    [
        "DELETE FROM onceflow.source_units WHERE job = 'bench_events' AND window_id IN (3, 17)",
        "UPDATE onceflow.source_units SET window_id = 1000 WHERE job = 'bench_events'"
        " AND window_id = 8",
        "TRUNCATE onceflow.source_units",
        "DROP TABLE onceflow.source_units CASCADE",
    ],
    ids=["rows deleted", "rows moved", "truncated", "dropped"],
)
def test_damage_below_the_verified_point_is_still_found(
    history: tuple[Settings, Engine], pg_dsn: str, damage: str
) -> None:
    """Start-up checks only what changed since the point it last verified, and rows removed
    from below that point are among what changed: the unit index is made whole again."""
    _, engine = history
    engine.start(f"t-{uuid.uuid4().hex}")
    assert _verified(pg_dsn) == WINDOWS
    whole = _units(pg_dsn)
    assert whole == {w: 1 for w in range(1, WINDOWS + 1)}
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(damage)
    Engine(JOB, engine.settings, None, pg_dsn).start(f"t-{uuid.uuid4().hex}")  # a new run
    after = _units(pg_dsn)
    after.pop(1000, None)  # a unit moved to a window that is not planned is released
    assert after == whole
    assert _verified(pg_dsn) == WINDOWS


def test_plan_rows_deleted_below_the_verified_point_are_put_back(
    history: tuple[Settings, Engine], pg_dsn: str, counted: dict[str, int]
) -> None:
    _, engine = history
    before = {w.window_id: w.offsets for w in Ledger(pg_dsn, JOB.name).windows()}
    engine.start(f"t-{uuid.uuid4().hex}")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "DELETE FROM onceflow.windows WHERE job = %s AND window_id IN (2, 11)", (JOB.name,)
        )
    _reset(counted)
    engine.start(f"t-{uuid.uuid4().hex}")
    assert counted["ledger_windows"] == 0
    assert {w.window_id: w.offsets for w in Ledger(pg_dsn, JOB.name).windows()} == before
    assert _units(pg_dsn) == {w: 1 for w in range(1, WINDOWS + 1)}
