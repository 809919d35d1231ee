"""onceflow.window.complete: a window's keys move into the key index beside its sinks' commits,
and the window is completed once, whatever becomes of that move's transaction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from onceflow.engine import build_engine
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.settings import Settings
from onceflow.window import complete
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.pgproxy import PgProxy


def _index(dsn: str) -> tuple[dict[str, int], list[int]]:
    with psycopg.connect(dsn) as conn:
        keys = conn.execute(
            "SELECT key, window_id FROM onceflow.dedupe_keys WHERE job = 'payments'"
        ).fetchall()
        windows = conn.execute(
            "SELECT window_id FROM onceflow.dedupe_windows WHERE job = 'payments' ORDER BY 1"
        ).fetchall()
    return {str(k): int(w) for k, w in keys}, [int(w) for (w,) in windows]


def _lake_keys(lake: Path) -> dict[str, int]:
    table = DeltaTable(str(lake / "payments")).to_pyarrow_table(
        columns=["payment_id", "_window_id"]
    )
    return dict(zip(table["payment_id"].to_pylist(), table["_window_id"].to_pylist(), strict=True))


@pytest.mark.parametrize("lost", [0, 1], ids=["answered", "lost"])
def test_keys_move_beside_the_commits_and_a_lost_answer_completes_the_window_once(
    spark: Any,
    pg_dsn: str,
    lake: Path,
    landing: Path,
    tmp_path: Path,
    lost: int,
    caplog: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The COMMIT of the transaction that moved window 1's keys beside its sinks' commits and
    then marked it completed loses its answer (`lost`): the window is completed again, as
    before there was a move beside the commits, and every window's keys are indexed once."""
    monkeypatch.setattr(complete, "EARLY_MIN_KEYS", 1)  # these windows' keys move early too
    generate_payments(landing, records=900, files=3, duplicate_rate=0.1, invalid_rate=0.05)
    dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    with PgProxy(pg_dsn) as proxy:
        # Window 1's: both transactions begin by taking the window's staged keys.
        proxy.lose_commit_of("SAVEPOINT onceflow_staged_keys", count=lost)
        through = proxy.dsn(str(dbname))
        settings = Settings(
            home=tmp_path / "home", postgres_dsn=through, lake=lake, landing=landing
        )
        with caplog.at_level(logging.INFO, logger="onceflow.window.complete"):
            result = build_engine(PAYMENTS, settings, spark, through).run(max_units_per_window=1)
        assert proxy.lost("commit") == lost
    again = [r.getMessage() for r in caplog.records if "completing it again" in r.getMessage()]
    assert again == (["window 1: completing it again"] if lost else [])
    assert [w.window_id for w in result.windows] == [1, 2, 3]
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
    keys, windows = _index(pg_dsn)
    assert windows == [1, 2, 3]
    assert keys == _lake_keys(lake)
    with psycopg.connect(pg_dsn) as conn:
        pending = conn.execute(
            "SELECT count(*) FROM onceflow.windows WHERE job = 'payments' AND completed_at IS NULL"
        ).fetchone()
    assert pending == (0,)
