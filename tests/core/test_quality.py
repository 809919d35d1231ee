"""Great Expectations suites: pass on consistent sinks, fail by sink and check on each damage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from psycopg import sql

from onceflow.ledger import Ledger
from onceflow.quality import ValidationReport, validate
from onceflow.quality._gx import sqlalchemy_url
from onceflow.sinks.delta._quality import DeltaTableTarget
from onceflow.sinks.postgres._markers import create_protocol_tables
from onceflow.sinks.postgres._quality import PostgresTableTarget, SumConsistency

JOB = "payments"
APP_ID = "onceflow/payments/lake_payments"
REPO = Path(__file__).resolve().parents[2]

DDL = """
CREATE TABLE onceflow.quarantine (job text NOT NULL, window_id bigint NOT NULL,
  source_file text NOT NULL, source_line bigint NOT NULL, raw_line text NOT NULL,
  reason text NOT NULL, quarantined_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (job, source_file, source_line));
CREATE TABLE public.payments (payment_id text PRIMARY KEY, merchant_id text NOT NULL,
  customer_id text NOT NULL, amount_cents bigint NOT NULL, currency text NOT NULL,
  created_at timestamptz NOT NULL, _window_id bigint NOT NULL, _source_file text NOT NULL,
  _source_line bigint NOT NULL);
CREATE TABLE public.merchant_balances (merchant_id text, currency text,
  total_cents bigint NOT NULL, payment_count bigint NOT NULL,
  PRIMARY KEY (merchant_id, currency));
"""

PAYMENT_COLUMNS = (
    "payment_id",
    "merchant_id",
    "customer_id",
    "amount_cents",
    "currency",
    "created_at",
    "_window_id",
    "_source_file",
    "_source_line",
)
CURRENCY = {"currency": "^[A-Z]{3}$"}
QUARANTINED_PER_WINDOW = 2


def payments_targets(lake: Path) -> list[PostgresTableTarget | DeltaTableTarget | SumConsistency]:
    """The payments job's sinks, as the job definition describes them."""
    return [
        PostgresTableTarget(
            sink="pg_payments",
            schema="public",
            table="payments",
            key=("payment_id",),
            expected_rows_from="markers",
            not_null=PAYMENT_COLUMNS,
            regex=CURRENCY,
        ),
        PostgresTableTarget(
            sink="pg_merchant_balances",
            schema="public",
            table="merchant_balances",
            key=("merchant_id", "currency"),
            expected_rows_from="none",
            not_null=("merchant_id", "currency", "total_cents", "payment_count"),
            regex=CURRENCY,
        ),
        SumConsistency(
            sink="pg_merchant_balances",
            balances=("public", "merchant_balances"),
            group_keys=("merchant_id", "currency"),
            total_col="total_cents",
            count_col="payment_count",
            source=("public", "payments"),
            amount_col="amount_cents",
        ),
        PostgresTableTarget(
            sink="pg_quarantine",
            schema="onceflow",
            table="quarantine",
            key=("source_file", "source_line"),
            expected_rows_from="markers",
            not_null=("source_file", "source_line", "raw_line", "reason"),
            row_filter={"job": JOB},
        ),
        DeltaTableTarget(
            sink="lake_payments",
            path=str(lake / "payments"),
            key=("payment_id",),
            expected_output="payments",
            app_id=APP_ID,
            not_null=PAYMENT_COLUMNS,
            regex=CURRENCY,
        ),
    ]


def _payments_table(n: int, windows: int) -> pa.Table:
    start = datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    window_of = [1 + i * windows // n for i in range(n)]
    return pa.table(
        {
            "payment_id": pa.array([f"pay-{i:08d}" for i in range(n)]),
            "merchant_id": pa.array([f"m{i % 7}" for i in range(n)]),
            "customer_id": pa.array([f"c{i % 101}" for i in range(n)]),
            "amount_cents": pa.array([(i * 37) % 10_000 - 500 for i in range(n)], pa.int64()),
            "currency": pa.array([("EUR", "USD", "GBP")[i % 3] for i in range(n)]),
            "created_at": pa.array(
                [start + timedelta(seconds=i) for i in range(n)], pa.timestamp("us", tz="UTC")
            ),
            "_window_id": pa.array(window_of, pa.int64()),
            "_source_file": pa.array([f"payments/f{w:04d}.jsonl" for w in window_of]),
            "_source_line": pa.array(range(1, n + 1), pa.int64()),
        }
    )


@dataclass
class Sinks:
    dsn: str
    lake: Path
    payments: int
    windows: int

    @property
    def delta_path(self) -> str:
        return str(self.lake / "payments")

    def targets(self) -> list[PostgresTableTarget | DeltaTableTarget | SumConsistency]:
        return payments_targets(self.lake)

    def sql(self, query: str, params: dict | None = None) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(query, params)


def fill(dsn: str, lake: Path, n: int, windows: int) -> Sinks:
    """Create the sink tables and fill them as a clean run of `windows` windows would."""
    table = _payments_table(n, windows)
    rows = table.to_pylist()
    Ledger(dsn, JOB).ensure_schema()  # the ledger's own tables, as a run creates them
    with psycopg.connect(dsn) as conn:
        create_protocol_tables(conn)  # the markers' tables, as the sinks' group creates them
        conn.execute(DDL)
        copy_sql = sql.SQL("COPY public.payments ({}) FROM STDIN").format(
            sql.SQL(", ").join(map(sql.Identifier, PAYMENT_COLUMNS))
        )
        with conn.cursor().copy(copy_sql) as copy:
            for row in rows:
                copy.write_row([row[c] for c in PAYMENT_COLUMNS])
        conn.execute(
            "INSERT INTO public.merchant_balances "
            "SELECT merchant_id, currency, sum(amount_cents), count(*) FROM public.payments "
            "GROUP BY merchant_id, currency"
        )
        for w in range(1, windows + 1):
            in_window = [r for r in rows if r["_window_id"] == w]
            source = f"payments/f{w:04d}.jsonl"
            for q in range(QUARANTINED_PER_WINDOW):
                conn.execute(
                    "INSERT INTO onceflow.quarantine "
                    "(job, window_id, source_file, source_line, raw_line, reason) "
                    "VALUES (%s, %s, %s, %s, %s, %s)",
                    (JOB, w, source, n + 1 + q, '{"payment_id": ""}', "payment_id is empty"),
                )
            groups = {(r["merchant_id"], r["currency"]) for r in in_window}
            outputs = {
                "payments": len(in_window),
                "balances": len(groups),
                "quarantine": QUARANTINED_PER_WINDOW,
            }
            stats = {
                "rows_in": len(in_window) + QUARANTINED_PER_WINDOW,
                "valid": len(in_window),
                "duplicates": 0,
                "quarantined": QUARANTINED_PER_WINDOW,
                "outputs": outputs,
            }
            offsets = json.dumps({"files": [source]})
            conn.execute(
                "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, stats, completed_at) "
                "VALUES (%s, %s, %s, 1, %s, now())",
                (JOB, w, offsets, json.dumps(stats)),
            )
            for sink, written in (
                ("pg_payments", outputs["payments"]),
                ("pg_merchant_balances", outputs["balances"]),
                ("pg_quarantine", outputs["quarantine"]),
            ):
                conn.execute(
                    "INSERT INTO onceflow.sink_commits "
                    "(job, sink, window_id, epoch, xid, run_id, offsets, rows_written) "
                    "VALUES (%s, %s, %s, 1, pg_current_xact_id(), 'run-1', %s, %s)",
                    (JOB, sink, w, offsets, written),
                )
    path = str(lake / "payments")
    for w in range(1, windows + 1):
        part = table.filter(pc.equal(table["_window_id"], w))
        write_deltalake(
            path,
            part,
            mode="append",
            commit_properties=CommitProperties(app_transactions=[Transaction(APP_ID, w)]),
        )
    return Sinks(dsn=dsn, lake=lake, payments=n, windows=windows)


@pytest.fixture()
def sinks(pg_dsn: str, lake: Path) -> Sinks:
    return fill(pg_dsn, lake, n=600, windows=3)


def run(sinks: Sinks, spark, **kwargs) -> ValidationReport:
    return validate(JOB, sinks.targets(), dsn=sinks.dsn, spark=spark, **kwargs)


def failed(report: ValidationReport) -> set[tuple[str, str]]:
    return {(r.sink, r.check) for r in report.failures()}


def result(report: ValidationReport, sink: str, check: str):
    matches = [r for r in report.results if (r.sink, r.check) == (sink, check)]
    assert len(matches) == 1, (sink, check, report.results)
    return matches[0]


def test_great_expectations_imports_in_a_subprocess() -> None:
    # From the repo root, as `python -c` and `dagster dev` run: platform/ must not shadow the
    # stdlib, and pyspark's connect check must not end the interpreter silently.
    env = {**os.environ, "GX_ANALYTICS_ENABLED": "false"}
    done = subprocess.run(
        [sys.executable, "-c", "import great_expectations as gx; print('gx', gx.__version__)"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gx 1."), (done.stdout, done.stderr)


def test_clean_sinks_pass_every_check(sinks: Sinks, spark) -> None:
    report = run(sinks, spark)

    assert report.passed, report.failures()
    assert report.failures() == []
    checks = {(r.sink, r.check) for r in report.results}
    for sink in ("pg_payments", "lake_payments"):
        assert {(sink, "keys_unique"), (sink, "row_count"), (sink, "regex:currency")} <= checks
        assert {(sink, f"not_null:{c}") for c in PAYMENT_COLUMNS} <= checks
    assert ("pg_merchant_balances", "sum_consistency") in checks
    assert ("pg_merchant_balances", "keys_unique") in checks
    assert ("pg_merchant_balances", "row_count") not in checks
    assert {("pg_quarantine", "keys_unique"), ("pg_quarantine", "row_count")} <= checks

    assert result(report, "pg_payments", "row_count").observed == {"rows": 600, "expected": 600}
    lake_rows = result(report, "lake_payments", "row_count").observed
    assert lake_rows["rows"] == lake_rows["expected"] == 600
    assert lake_rows["committed_window"] == 3
    assert result(report, "pg_quarantine", "row_count").observed == {"rows": 6, "expected": 6}
    assert result(report, "lake_payments", "keys_unique").observed == {
        "duplicate_keys": 0,
        "expected": 0,
        "extra_copies": 0,
    }
    assert set(report.timings) >= {
        "payments.pg_payments",
        "payments.pg_merchant_balances",
        "payments.pg_merchant_balances.sum_consistency",
        "payments.pg_quarantine",
        "payments.lake_payments",
        "payments.lake_payments:spark",
    }


def test_duplicate_row_in_delta_fails_keys_unique(sinks: Sinks, spark) -> None:
    # A replayed window written without the app-transaction guard: one payment twice.
    table = DeltaTable(sinks.delta_path).to_pyarrow_table()
    write_deltalake(sinks.delta_path, table.slice(10, 1), mode="append")

    report = run(sinks, spark)

    assert not report.passed
    assert failed(report) == {("lake_payments", "keys_unique"), ("lake_payments", "row_count")}
    dup = result(report, "lake_payments", "keys_unique")
    assert dup.observed["duplicate_keys"] == 1
    assert dup.observed["extra_copies"] == 1
    assert "lake_payments" in dup.description
    assert result(report, "lake_payments", "row_count").observed["rows"] == 601


def test_missing_payment_in_postgres_fails_row_count(sinks: Sinks, spark) -> None:
    sinks.sql("DELETE FROM public.payments WHERE payment_id = 'pay-00000042'")

    report = run(sinks, spark)

    assert ("pg_payments", "row_count") in failed(report)
    # The balances still count the lost payment, so they no longer match the payments.
    assert failed(report) == {
        ("pg_payments", "row_count"),
        ("pg_merchant_balances", "sum_consistency"),
    }
    assert result(report, "pg_payments", "row_count").observed == {"rows": 599, "expected": 600}


def test_missing_payment_in_delta_fails_row_count(sinks: Sinks, spark) -> None:
    DeltaTable(sinks.delta_path).delete("payment_id = 'pay-00000042'")

    report = run(sinks, spark)

    assert failed(report) == {("lake_payments", "row_count")}
    observed = result(report, "lake_payments", "row_count").observed
    assert (observed["rows"], observed["expected"]) == (599, 600)


def test_wrong_balance_fails_sum_consistency(sinks: Sinks, spark) -> None:
    sinks.sql(
        "UPDATE public.merchant_balances SET total_cents = total_cents + 1 "
        "WHERE merchant_id = 'm3' AND currency = 'USD'"
    )

    report = run(sinks, spark)

    assert failed(report) == {("pg_merchant_balances", "sum_consistency")}
    assert result(report, "pg_merchant_balances", "sum_consistency").observed == {
        "mismatched_groups": 1
    }


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE public.merchant_balances SET payment_count = payment_count + 1 "
        "WHERE merchant_id = 'm1' AND currency = 'EUR'",
        "INSERT INTO public.merchant_balances VALUES ('m-none', 'EUR', 0, 0)",
        "DELETE FROM public.merchant_balances WHERE merchant_id = 'm2' AND currency = 'GBP'",
    ],
    ids=["wrong-count", "balance-without-payments", "payments-without-balance"],
)
def test_balance_damage_fails_sum_consistency(sinks: Sinks, spark, damage: str) -> None:
    sinks.sql(damage)

    report = run(sinks, spark)

    assert failed(report) == {("pg_merchant_balances", "sum_consistency")}


def test_lost_quarantine_row_fails_row_count(sinks: Sinks, spark) -> None:
    sinks.sql(
        "DELETE FROM onceflow.quarantine WHERE job = 'payments' AND window_id = 2 "
        "AND source_line = 602"
    )

    report = run(sinks, spark)

    assert failed(report) == {("pg_quarantine", "row_count")}
    assert result(report, "pg_quarantine", "row_count").observed == {"rows": 5, "expected": 6}


def test_extra_quarantine_row_fails_row_count(sinks: Sinks, spark) -> None:
    # The same position twice is impossible (primary key); an unaccounted row is not.
    sinks.sql(
        "INSERT INTO onceflow.quarantine (job, window_id, source_file, source_line, raw_line, "
        "reason) VALUES ('payments', 1, 'payments/f0001.jsonl', 9999, 'x', 'not a JSON object')"
    )

    report = run(sinks, spark)

    assert failed(report) == {("pg_quarantine", "row_count")}
    assert result(report, "pg_quarantine", "row_count").observed == {"rows": 7, "expected": 6}


def test_quarantine_rows_of_other_jobs_are_not_counted(sinks: Sinks, spark) -> None:
    sinks.sql(
        "INSERT INTO onceflow.quarantine (job, window_id, source_file, source_line, raw_line, "
        "reason) VALUES ('refunds', 1, 'refunds/a.jsonl', 1, 'x', 'not a JSON object')"
    )

    assert run(sinks, spark).passed


def test_bad_currency_fails_regex(sinks: Sinks, spark) -> None:
    sinks.sql("UPDATE public.payments SET currency = 'usd' WHERE payment_id = 'pay-00000007'")

    report = run(sinks, spark)

    # The balances still hold the old group, so they disagree with the payments too.
    assert failed(report) == {
        ("pg_payments", "regex:currency"),
        ("pg_merchant_balances", "sum_consistency"),
    }
    assert result(report, "pg_payments", "regex:currency").observed == {
        "mismatches": 1,
        "rows": 600,
    }


def test_delta_table_gone_fails_row_count(sinks: Sinks, spark) -> None:
    shutil.rmtree(sinks.delta_path)

    report = run(sinks, spark)

    assert failed(report) == {("lake_payments", "row_count")}
    observed = result(report, "lake_payments", "row_count").observed
    assert (observed["rows"], observed["expected"], observed["table_missing"]) == (0, 600, 1)


def test_delta_window_missing_from_ledger_fails_row_count(sinks: Sinks, spark) -> None:
    sinks.sql("DELETE FROM onceflow.windows WHERE job = 'payments' AND window_id = 2")

    report = run(sinks, spark)

    assert failed(report) == {("lake_payments", "row_count")}
    assert result(report, "lake_payments", "row_count").observed["windows_missing_from_ledger"] == 1


def test_missing_table_fails_its_suite_without_raising(sinks: Sinks, spark) -> None:
    sinks.sql("DROP TABLE public.merchant_balances")

    report = run(sinks, spark)

    assert {sink for sink, _ in failed(report)} == {"pg_merchant_balances"}
    assert all("error" in r.observed for r in report.failures()), report.failures()


def test_data_docs_are_built_and_hold_no_secret(sinks: Sinks, spark, tmp_path: Path) -> None:
    # The embedded server trusts local connections, so the password is carried but unused.
    secret = "pw-do-not-leak-7f3a"
    params = psycopg.conninfo.conninfo_to_dict(sinks.dsn)
    dsn = psycopg.conninfo.make_conninfo(**{**params, "password": secret})
    docs = tmp_path / "docs"

    first = validate(JOB, sinks.targets(), dsn=dsn, spark=spark, data_docs_dir=docs)
    second = validate(JOB, sinks.targets(), dsn=dsn, spark=spark, data_docs_dir=docs)

    assert first.passed and second.passed
    assert second.data_docs is not None
    index = Path(second.data_docs)
    assert index.name == "index.html" and index.is_file()
    assert docs in index.parents
    assert "payments.pg_payments" in index.read_text()
    # A failing run must not copy the offending values into the docs either.
    sinks.sql("UPDATE public.payments SET currency = 'xqz' WHERE payment_id = 'pay-00000007'")
    third = validate(JOB, sinks.targets(), dsn=dsn, spark=spark, data_docs_dir=docs)
    assert ("pg_payments", "regex:currency") in failed(third)
    for path in docs.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert secret.encode() not in text, path
            assert b"postgresql+psycopg" not in text, path
            assert b"xqz" not in text and b"pay-00000007" not in text, path


def test_sqlalchemy_url_keeps_the_socket_and_hides_the_password() -> None:
    url = sqlalchemy_url("postgresql://alice:s%3Acret@/ledger?host=/run/pg&sslmode=disable")
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.database) == ("alice", "s:cret", "ledger")
    assert url.host == "localhost"
    assert url.query == {"host": "/run/pg", "sslmode": "disable"}
    assert "s:cret" not in str(url) and "s:cret" not in repr(url)

    tcp = sqlalchemy_url("host=db.internal port=6432 dbname=ledger user=bob")
    assert (tcp.host, tcp.port, tcp.database, tcp.password) == ("db.internal", 6432, "ledger", None)
    assert dict(tcp.query) == {}


def test_names_longer_than_postgres_allows_are_rejected() -> None:
    with pytest.raises(ValueError, match="63 bytes"):
        PostgresTableTarget(
            sink="s", schema="public", table="t" * 64, key=("id",), expected_rows_from="none"
        )
    with pytest.raises(ValueError, match="key"):
        PostgresTableTarget(sink="s", schema="public", table="t", key=(), expected_rows_from="none")


def test_suites_are_fast_on_100k_rows(pg_dsn: str, lake: Path, spark) -> None:
    sinks = fill(pg_dsn, lake, n=100_000, windows=10)
    cold = run(sinks, spark)  # warms GE's metric registry and Spark's code paths

    report = run(sinks, spark)

    assert report.passed, report.failures()
    assert result(report, "lake_payments", "row_count").observed["rows"] == 100_000
    print("cold", {name: round(seconds, 3) for name, seconds in cold.timings.items()})
    print("warm", {name: round(seconds, 3) for name, seconds in report.timings.items()})
    # A guard against gross regressions (a driver-side collect, GE on a Spark DataFrame), loose
    # enough for a busy 2-core machine; the figures themselves are printed above.
    for name, seconds in report.timings.items():
        assert seconds < 10.0, (name, seconds)
