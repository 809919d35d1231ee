"""Reconcile against real PostgreSQL, Spark and Delta: damage by hand, report it exactly, repair it."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from onceflow.engine import Engine
from onceflow.errors import ConfigurationError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import _raw_text
from onceflow.reconcile import ReconcileReport, SinkDiff, format_report, reconcile
from onceflow.registry import get_job
from onceflow.settings import Settings
from onceflow.windows import parse_interval
from tests.support.oracle import Expected, expected_outputs, visible_files


def _engine(tmp_path: Path, pg_dsn: str, lake: Path, landing: Path, spark) -> Engine:
    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    settings.check_folders()
    return Engine(get_job("payments"), settings, spark, pg_dsn)


def _delta_rows(lake: Path) -> pa.Table:
    table = DeltaTable(str(lake / "payments"))
    parts = [pq.read_table(uri) for uri in table.file_uris()]
    return pa.concat_tables(parts) if parts else pa.table({})


def _assert_exact(pg_dsn: str, lake: Path, truth: Expected) -> None:
    """Every output holds exactly the oracle's rows: no row lost, doubled or changed."""
    want = {pid: row for pid, row in truth.payments.items()}
    delta = _delta_rows(lake).to_pylist()
    fields = ("payment_id", "merchant_id", "customer_id", "amount_cents", "currency",
              "created_at", "_source_file", "_source_line")  # fmt: skip
    delta_rows = [tuple(r[f] for f in fields) for r in delta]
    assert len(delta_rows) == len(want)
    assert {r[0]: r for r in delta_rows} == want
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT payment_id, merchant_id, customer_id, amount_cents, currency, created_at,"
            " _source_file, _source_line FROM payments"
        ).fetchall()
        assert {r[0]: tuple(r) for r in rows} == want
        balances = conn.execute(
            "SELECT merchant_id, currency, total_cents, payment_count FROM merchant_balances"
        ).fetchall()
        assert {(m, c): (t, n) for m, c, t, n in balances} == truth.balances
        quarantine = conn.execute(
            "SELECT source_file, source_line, raw_line, reason FROM onceflow.quarantine"
            " WHERE job = 'payments'"
        ).fetchall()
        assert {(f, n): raw for f, n, raw, _ in quarantine} == {
            k: _raw_text(raw) for k, raw in truth.quarantine.items()
        }
        assert {(f, n): why for f, n, _, why in quarantine} == truth.reasons


def _counts(report: ReconcileReport) -> dict[str, tuple[int, int, int]]:
    return {s.sink: (s.missing, s.extra, s.changed) for s in report.sinks}


def _damage(pg_dsn: str, lake: Path) -> None:
    """Damage done outside onceflow, one kind per output."""
    with psycopg.connect(pg_dsn) as conn:
        ids = [r[0] for r in conn.execute(
            "SELECT payment_id FROM payments ORDER BY payment_id LIMIT 7"
        ).fetchall()]  # fmt: skip
        # 5 rows deleted by hand, 1 amount changed, 1 row that never belonged added.
        conn.execute("DELETE FROM payments WHERE payment_id = ANY(%s)", (ids[:5],))
        conn.execute(
            "UPDATE payments SET amount_cents = amount_cents + 1 WHERE payment_id = %s", (ids[5],)
        )
        conn.execute(
            "INSERT INTO payments SELECT 'never-belonged', merchant_id, customer_id, 1, currency,"
            " created_at, _window_id, _source_file, 999999 FROM payments WHERE payment_id = %s",
            (ids[6],),
        )
        # One balance off by a dollar.
        conn.execute(
            "UPDATE merchant_balances SET total_cents = total_cents + 100 WHERE (merchant_id,"
            " currency) = (SELECT merchant_id, currency FROM merchant_balances"
            " ORDER BY 1, 2 LIMIT 1)"
        )
        # One quarantined line lost.
        conn.execute(
            "DELETE FROM onceflow.quarantine WHERE (source_file, source_line) = (SELECT"
            " source_file, source_line FROM onceflow.quarantine ORDER BY 1, 2 LIMIT 1)"
        )
        conn.commit()
    # Delta: 4 rows appended a second time, and one row that never belonged.
    rows = _delta_rows(lake)
    copies = rows.slice(0, 4)
    stranger = rows.slice(10, 1).to_pylist()[0]
    stranger["payment_id"] = "never-belonged"
    extra = pa.concat_tables([copies, pa.Table.from_pylist([stranger], schema=rows.schema)])
    write_deltalake(str(lake / "payments"), extra, mode="append")


def test_dry_run_reports_exact_damage_and_repair_makes_every_output_exact(
    tmp_path, pg_dsn, lake, landing, spark
):
    generate_payments(landing, records=2000, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=7)
    files = visible_files(landing)
    engine = _engine(tmp_path, pg_dsn, lake, landing, spark)
    engine.run(max_units_per_window=2, max_windows=2)
    truth = expected_outputs(landing, windows=[files[:4]])
    _assert_exact(pg_dsn, lake, truth)

    _damage(pg_dsn, lake)
    damage = {
        "lake_payments": (0, 5, 0),
        "pg_payments": (5, 1, 1),
        "pg_merchant_balances": (0, 0, 1),
        "pg_quarantine": (1, 0, 0),
    }
    dry = reconcile(engine, dry_run=True)
    assert _counts(dry) == damage, format_report(dry)
    assert dry.windows_checked == [1, 2]
    assert not any(s.repaired for s in dry.sinks)
    assert not dry.clean
    with pytest.raises(AssertionError):
        _assert_exact(pg_dsn, lake, truth)  # the dry run changed nothing

    repair = reconcile(engine)
    assert _counts(repair) == damage, format_report(repair)
    assert all(s.repaired for s in repair.sinks)
    _assert_exact(pg_dsn, lake, truth)

    again = reconcile(engine)
    assert again.clean, format_report(again)
    assert _counts(again) == {name: (0, 0, 0) for name in damage}
    print(f"\nreconcile wall time: dry {dry.wall_s:.1f}s, repair {repair.wall_s:.1f}s, "
          f"clean {again.wall_s:.1f}s")  # fmt: skip
    print(format_report(repair))

    # Incremental: only windows after the last verified one are compared (balances in full).
    engine.run(max_units_per_window=2)
    with psycopg.connect(pg_dsn) as conn:
        for wid in (1, 3):
            conn.execute(
                "DELETE FROM payments WHERE payment_id = (SELECT min(payment_id) FROM payments"
                " WHERE _window_id = %s)",
                (wid,),
            )
        # A balance changed by hand too.
        conn.execute(
            "UPDATE merchant_balances SET payment_count = payment_count + 1 WHERE (merchant_id,"
            " currency) = (SELECT merchant_id, currency FROM merchant_balances ORDER BY 1, 2"
            " LIMIT 1)"
        )
        conn.commit()
    incremental = reconcile(engine, dry_run=True, mode="incremental")
    assert incremental.windows_checked == [3]
    # Only window 3 is read again: its duplicates of windows 1 and 2 found in the key index.
    assert (incremental.windows_recomputed, incremental.recomputed_after) == (1, 2)
    assert _counts(incremental)["pg_payments"] == (1, 0, 0)  # window 1 was verified before
    # The balances are compared whole, against the state the repair left them in plus window 3.
    assert _counts(incremental)["pg_merchant_balances"] == (0, 0, 1)

    repaired = reconcile(engine, mode="incremental")
    assert _counts(repaired)["pg_payments"] == (1, 0, 0)
    assert _counts(repaired)["pg_merchant_balances"] == (0, 0, 1)
    assert repaired.windows_recomputed == 1
    steady = reconcile(engine, dry_run=True, mode="incremental")
    assert steady.clean and steady.windows_recomputed == 0, format_report(steady)
    # A full reconcile recomputes every window and finds what incremental left alone.
    full = reconcile(engine)
    assert full.windows_recomputed == 3
    assert _counts(full)["pg_payments"] == (1, 0, 0)
    _assert_exact(pg_dsn, lake, expected_outputs(landing, windows=[files[:4], files[4:6]]))


def test_report_format_lists_every_sink() -> None:
    report = ReconcileReport(
        "payments", "full", True, [1, 2, 3, 5], [(4, "payments/x.jsonl: missing")],
        [SinkDiff("pg_payments", 5, 1, 2, False), SinkDiff("b", 0, 0, 0, False, "why")],
        1.25,
    )  # fmt: skip
    text = format_report(report)
    assert "1-3, 5" in text
    assert "window 4: unverifiable" in text
    assert "pg_payments" in text and "       5         1         2" in text
    assert "not checked: why" in text
    assert not report.clean


def _delta_window_ids(lake: Path) -> list[int]:
    history = DeltaTable(str(lake / "payments")).history()
    return sorted(int(e["onceflow.window_id"]) for e in history if "onceflow.window_id" in e)


@pytest.mark.parametrize(
    "loss",
    [
        "DELETE FROM onceflow.windows; DELETE FROM onceflow.source_units",
        # CASCADE: the lineage view reads the windows; it goes with them, and comes back.
        "DROP TABLE onceflow.windows CASCADE; DROP TABLE onceflow.source_units",
    ],
    ids=["delete", "drop"],
)
def test_ledger_lost_between_runs_is_rebuilt_and_the_next_run_is_exact(
    loss, tmp_path, pg_dsn, lake, landing, spark
):
    generate_payments(landing, records=1200, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=3)
    _engine(tmp_path, pg_dsn, lake, landing, spark).run(max_units_per_window=2, max_windows=2)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(loss)
        conn.commit()

    result = _engine(tmp_path, pg_dsn, lake, landing, spark).run(max_units_per_window=2)

    # The two committed windows come back from the sinks and change nothing; the rest of the
    # input becomes window 3: no window skipped, none doubled.
    assert [(w.window_id, w.noop) for w in result.windows] == [(1, True), (2, True), (3, False)]
    assert _delta_window_ids(lake) == [1, 2, 3]
    _assert_exact(pg_dsn, lake, expected_outputs(landing))


def test_source_files_lost_alone_is_rebuilt(tmp_path, pg_dsn, lake, landing, spark):
    generate_payments(landing, records=600, files=4, duplicate_rate=0.1, invalid_rate=0.05, seed=4)
    _engine(tmp_path, pg_dsn, lake, landing, spark).run(max_units_per_window=2)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM onceflow.source_units")
        conn.commit()
    result = _engine(tmp_path, pg_dsn, lake, landing, spark).run(max_units_per_window=2)
    assert [w.window_id for w in result.windows if not w.noop] == []
    assert _delta_window_ids(lake) == [1, 2]


def _payment_ids(path: Path) -> set[str]:
    ids = set()
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():
        try:
            ids.add(json.loads(line)["payment_id"])
        except (ValueError, KeyError, TypeError):
            continue  # an invalid line
    return ids


@pytest.mark.parametrize("mode", ["full", "incremental"])
def test_window_with_deleted_input_is_unverifiable_and_left_alone(
    tmp_path, pg_dsn, lake, landing, spark, mode
):
    generate_payments(landing, records=1200, files=6, duplicate_rate=0.1, invalid_rate=0.05, seed=5)
    files = visible_files(landing)
    # Window 3 repeats payments window 2 took first: its expected rows leave them out even
    # when window 2 is not recomputed (its keys come from the sinks and the key index).
    assert set.union(*(_payment_ids(landing / f) for f in files[4:])) & set.union(
        *(_payment_ids(landing / f) for f in files[2:4])
    )
    engine = _engine(tmp_path, pg_dsn, lake, landing, spark)
    if mode == "incremental":  # verified through window 1 by a reconcile of its own
        engine.run(max_units_per_window=2, max_windows=1)
        assert reconcile(engine).clean
    engine.run(max_units_per_window=2)
    with psycopg.connect(pg_dsn) as conn:
        lost = {}
        for wid in (2, 3):
            row = conn.execute(
                "DELETE FROM payments WHERE payment_id = (SELECT min(payment_id) FROM payments"
                " WHERE _window_id = %s) RETURNING payment_id",
                (wid,),
            ).fetchone()
            lost[wid] = row[0]
        conn.commit()
    (landing / files[2]).unlink()  # the first file of window 2

    dry = reconcile(engine, dry_run=True, mode=mode)
    assert dry.unverifiable == [(2, f"{files[2]}: missing")]
    assert dry.windows_checked == ([1, 3] if mode == "full" else [3])
    assert dry.windows_recomputed == (2 if mode == "full" else 1)
    counts = _counts(dry)
    assert counts["pg_payments"] == (1, 0, 0)  # only window 3's loss: window 2 is left alone
    assert counts["lake_payments"] == counts["pg_quarantine"] == (0, 0, 0)
    balances = next(s for s in dry.sinks if s.sink == "pg_merchant_balances")
    assert balances.skipped is not None
    assert not dry.clean
    assert "window 2: unverifiable" in format_report(dry)

    repair = reconcile(engine, mode=mode)
    assert _counts(repair)["pg_payments"] == (1, 0, 0)
    with psycopg.connect(pg_dsn) as conn:
        present = {
            r[0]
            for r in conn.execute(
                "SELECT payment_id FROM payments WHERE payment_id = ANY(%s)", (list(lost.values()),)
            ).fetchall()
        }
    assert present == {lost[3]}  # window 3 repaired, window 2 never guessed


def test_refuses_when_delta_forgets_windows_before_the_replay_horizon(
    tmp_path, pg_dsn, lake, landing, spark
):
    generate_payments(landing, records=200, files=1, seed=6)
    engine = _engine(tmp_path, pg_dsn, lake, landing, spark)
    engine.run()
    DeltaTable(str(lake / "payments")).alter.set_table_properties(
        {"delta.setTransactionRetentionDuration": "interval 1 days"}
    )
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE onceflow.windows SET planned_at = now() - interval '2 days'")
        conn.commit()
    with pytest.raises(ConfigurationError, match="setTransactionRetentionDuration"):
        reconcile(engine, dry_run=True)
    DeltaTable(str(lake / "payments")).alter.set_table_properties(
        {"delta.setTransactionRetentionDuration": "interval 1 weeks"}
    )
    assert reconcile(engine, dry_run=True).clean

    # A saved xid too old for pg_xact_status (here: one long frozen) never decides anything:
    # the commit marker does, present or absent.
    from onceflow.sinks.postgres._markers import Marker
    from onceflow.sinks.postgres.commit import Transaction

    tx = Transaction("payments", pg_dsn, engine.ledger)
    epoch = engine.ledger.current_epoch() or 0
    assert tx._resolve(Marker("payments", "pg_payments", 1), "3", epoch)
    assert not tx._resolve(Marker("payments", "pg_payments", 99), "3", epoch)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("interval 7 days", timedelta(days=7)),
        ("interval 1 weeks", timedelta(weeks=1)),
        ("2 hours 30 minutes", timedelta(hours=2, minutes=30)),
        ("INTERVAL 1 DAY", timedelta(days=1)),
    ],
)
def test_parse_interval(text, expected) -> None:
    assert parse_interval(text) == expected


def test_parse_interval_rejects_nonsense() -> None:
    with pytest.raises(ConfigurationError):
        parse_interval("forever")
