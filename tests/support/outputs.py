"""What the `payments` sinks actually hold, and an exact comparison with the oracle's truth."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from onceflow.jobs.payments import PAYMENT_COLUMNS
from onceflow.storage import Location
from tests.support.oracle import Expected, PaymentRow

JOB = "payments"
PAYMENT_FIELDS = tuple(PAYMENT_COLUMNS)

# One stored payment: the oracle's 8 fields plus the window id the job gave it.
StoredPayment = tuple[str, str, str, int, str, datetime, int, str, int]


@dataclass(frozen=True)
class QuarantineRow:
    window_id: int
    source_file: str
    source_line: int
    raw_line: str
    reason: str


@dataclass(frozen=True)
class Actual:
    """Everything the job's sinks hold, as lists (so duplicates stay visible)."""

    delta_payments: list[StoredPayment]
    pg_payments: list[StoredPayment]
    balances: list[tuple[str, str, int, int]]
    quarantine: list[QuarantineRow]
    delta_version: int | None = None


@dataclass
class OutputDiff:
    lost: int = 0
    doubled: int = 0
    extra: int = 0
    changed: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.lost or self.doubled or self.extra or self.changed)

    def note(self, text: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(text)


def _payment(row: Any) -> StoredPayment:
    (pid, merchant, customer, amount, currency, created, wid, src, line) = row
    return (pid, merchant, customer, int(amount), currency, created, int(wid), src, int(line))


def read_delta_payments(lake: Path | Location) -> tuple[list[StoredPayment], int | None]:
    from deltalake import DeltaTable

    path = lake / "payments" if isinstance(lake, Location) else Location(str(lake / "payments"))
    if not DeltaTable.is_deltatable(path.uri, storage_options=path.delta_options()):
        return [], None
    table = DeltaTable(path.uri, storage_options=path.delta_options())
    data = table.to_pyarrow_table(columns=list(PAYMENT_FIELDS))
    columns = [data.column(name).to_pylist() for name in PAYMENT_FIELDS]
    return [_payment(row) for row in zip(*columns, strict=True)], table.version()


def _table_exists(conn: psycopg.Connection, name: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])


def actual_outputs(dsn: str, lake: Path | Location) -> Actual:
    """Read every output of the `payments` job: Delta, PG payments, balances and quarantine."""
    delta_rows, version = read_delta_payments(lake)
    pg_rows: list[StoredPayment] = []
    balances: list[tuple[str, str, int, int]] = []
    quarantine: list[QuarantineRow] = []
    with psycopg.connect(dsn) as conn:
        if _table_exists(conn, "public.payments"):
            cols = ", ".join(PAYMENT_FIELDS)
            pg_rows = [_payment(r) for r in conn.execute(f"SELECT {cols} FROM public.payments")]
        if _table_exists(conn, "public.merchant_balances"):
            balances = [
                (m, c, int(t), int(n))
                for m, c, t, n in conn.execute(
                    "SELECT merchant_id, currency, total_cents, payment_count"
                    " FROM public.merchant_balances"
                )
            ]
        if _table_exists(conn, "onceflow.quarantine"):
            quarantine = [
                QuarantineRow(int(w), f, int(n), raw, reason)
                for w, f, n, raw, reason in conn.execute(
                    "SELECT window_id, source_file, source_line, raw_line, reason"
                    " FROM onceflow.quarantine WHERE job = %s",
                    (JOB,),
                )
            ]
    return Actual(delta_rows, pg_rows, balances, quarantine, version)


def stored_raw_text(raw: bytes) -> str:
    # The quarantine keeps raw lines as text: invalid UTF-8 as backslash escapes, NUL as "\x00"
    # (PostgreSQL text cannot hold NUL); the core's rule, restated here on purpose.
    return raw.decode("utf-8", errors="backslashreplace").replace("\x00", "\\x00")


def _diff_payments(expected: dict[str, PaymentRow], rows: list[StoredPayment]) -> OutputDiff:
    diff = OutputDiff()
    grouped: dict[str, list[StoredPayment]] = {}
    for row in rows:
        grouped.setdefault(row[0], []).append(row)
    counts = {pid: len(group) for pid, group in grouped.items()}
    for pid, want in expected.items():
        if pid not in counts:
            diff.lost += 1
            diff.note(f"lost {pid}")
            continue
        if counts[pid] > 1:
            diff.doubled += counts[pid] - 1
            diff.note(f"{pid} x{counts[pid]}")
        for row in grouped[pid]:
            if row[:6] + row[7:] != want or row[6] < 1:
                diff.changed += 1
                diff.note(f"changed {pid}: {row!r} != {want!r}")
    for pid, n in counts.items():
        if pid not in expected:
            diff.extra += n
            diff.note(f"extra {pid} x{n}")
    return diff


def _diff_balances(
    expected: dict[tuple[str, str], tuple[int, int]], rows: list[tuple[str, str, int, int]]
) -> OutputDiff:
    """Balances in records: a count too high is doubled payments, too low is lost ones."""
    diff = OutputDiff()
    actual: dict[tuple[str, str], tuple[int, int]] = {}
    for merchant, currency, total, count in rows:
        key = (merchant, currency)
        if key in actual:
            diff.doubled += count
            diff.note(f"balance row {key} twice")
            continue
        actual[key] = (total, count)
    for key, (total, count) in expected.items():
        got_total, got_count = actual.get(key, (0, 0))
        if got_count > count:
            diff.doubled += got_count - count
        elif got_count < count:
            diff.lost += count - got_count
        elif got_total != total:
            diff.changed += 1
        if (got_total, got_count) != (total, count):
            diff.note(f"balance {key}: {(got_total, got_count)} != {(total, count)}")
    for key, (total, count) in actual.items():
        if key not in expected:
            diff.extra += max(count, 1)
            diff.note(f"extra balance {key}: {(total, count)}")
    return diff


def _diff_quarantine(
    expected: dict[tuple[str, int], bytes], rows: list[QuarantineRow]
) -> OutputDiff:
    diff = OutputDiff()
    counts = Counter((r.source_file, r.source_line) for r in rows)
    by_pos = {(r.source_file, r.source_line): r for r in rows}
    for pos, raw in expected.items():
        row = by_pos.get(pos)
        if row is None:
            diff.lost += 1
            diff.note(f"lost quarantine {pos}")
            continue
        if counts[pos] > 1:
            diff.doubled += counts[pos] - 1
        if row.raw_line != stored_raw_text(raw) or not row.reason.strip() or row.window_id < 1:
            diff.changed += 1
            diff.note(f"changed quarantine {pos}: {row!r}")
    for pos, n in counts.items():
        if pos not in expected:
            diff.extra += n
            diff.note(f"extra quarantine {pos}")
    return diff


def diff_outputs(expected: Expected, actual: Actual) -> dict[str, OutputDiff]:
    """Per output: lost, doubled, extra and changed records against the oracle."""
    diffs = {
        "delta payments": _diff_payments(expected.payments, actual.delta_payments),
        "pg payments": _diff_payments(expected.payments, actual.pg_payments),
        "merchant_balances": _diff_balances(expected.balances, actual.balances),
        "quarantine": _diff_quarantine(expected.quarantine, actual.quarantine),
    }
    # Both payment tables must agree on the window each payment came in.
    delta_windows = {r[0]: r[6] for r in actual.delta_payments}
    pg = diffs["pg payments"]
    for row in actual.pg_payments:
        if row[0] in delta_windows and delta_windows[row[0]] != row[6]:
            pg.changed += 1
            pg.note(f"{row[0]}: window {row[6]} in PG, {delta_windows[row[0]]} in Delta")
    return diffs


def assert_exact(expected: Expected, actual: Actual) -> dict[str, OutputDiff]:
    """Fail unless every output holds exactly the oracle's records: 0 lost, 0 doubled."""
    diffs = diff_outputs(expected, actual)
    bad = {name: d for name, d in diffs.items() if not d.exact}
    if bad:
        lines = [
            f"{name}: lost={d.lost} doubled={d.doubled} extra={d.extra} changed={d.changed}"
            f" e.g. {'; '.join(d.examples)}"
            for name, d in bad.items()
        ]
        raise AssertionError("outputs differ from the oracle:\n" + "\n".join(lines))
    return diffs
