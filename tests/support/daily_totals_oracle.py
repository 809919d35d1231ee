"""Plain-Python truth for the `daily_totals` job, and an exact comparison with what PostgreSQL holds.

The contract: `public.daily_totals` holds one row per (UTC date of `created_at`, currency) that
has payments, with `total_cents` = the exact sum of their `amount_cents` and `payment_count` =
their number, over the `payments` table's current rows. A (day, currency) without payments has
no row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import psycopg

from onceflow.storage import Location
from tests.support.oracle import expected_outputs

Key = tuple[date, str]
Totals = dict[Key, tuple[int, int]]  # (day, currency) -> (total_cents, payment_count)


def totals_of(payments: Iterable[tuple[int, str, datetime]]) -> Totals:
    """Per (UTC day, currency): the exact sum (Python int) and number of the payments.

    Args:
        payments: (amount_cents, currency, created_at) of each payment; created_at aware.
    """
    totals: Totals = {}
    for amount, currency, created_at in payments:
        assert created_at.tzinfo is not None, "created_at must be an aware datetime"
        key = (created_at.astimezone(UTC).date(), currency)
        total, count = totals.get(key, (0, 0))
        totals[key] = (total + int(amount), count + 1)
    return totals


def totals_from_landing(
    landing: Path, windows: list[list[str]] | None = None, *, amounts: dict[str, int] | None = None
) -> Totals:
    """The totals implied by the landing files (the payments that survive dedupe).

    Args:
        landing: The landing root.
        windows: The payments job's windows as relative file lists (None: one window of all
            visible files in name order, which is the same for input discovered in name order).
        amounts: Amounts that replace the source's, by payment_id (a restatement).
    """
    amounts = amounts or {}
    payments = expected_outputs(landing, windows=windows).payments
    return totals_of((amounts.get(pid, row[3]), row[4], row[5]) for pid, row in payments.items())


def delta_payment_rows(lake: Path | Location) -> list[tuple[str, int, str, datetime, str]]:
    """Current rows of the `payments` Delta table: (payment_id, amount, currency, created_at,
    source file), read with deltalake/pyarrow (no Spark)."""
    from deltalake import DeltaTable

    columns = ["payment_id", "amount_cents", "currency", "created_at", "_source_file"]
    path = lake / "payments" if isinstance(lake, Location) else Location(str(lake / "payments"))
    table = DeltaTable(path.uri, storage_options=path.delta_options()).to_pyarrow_table(
        columns=columns
    )
    data = [table.column(name).to_pylist() for name in columns]
    return [(p, int(a), c, t, f) for p, a, c, t, f in zip(*data, strict=True)]


def totals_from_delta(lake: Path | Location) -> Totals:
    """The totals over the `payments` Delta table's current rows (each payment_id once)."""
    rows = delta_payment_rows(lake)
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)), "the payments Delta table holds a payment_id twice"
    return totals_of((amount, currency, created) for _, amount, currency, created, _ in rows)


def actual_totals(dsn: str) -> list[tuple[date, str, int, int]]:
    """Every row of `public.daily_totals` (a list, so a doubled key stays visible)."""
    rows: list[tuple[date, str, int, int]] = []
    with psycopg.connect(dsn) as conn:
        exists = conn.execute("SELECT to_regclass('public.daily_totals') IS NOT NULL").fetchone()
        if not (exists and exists[0]):
            return rows
        for day, currency, total, count in conn.execute(
            "SELECT day, currency, total_cents, payment_count FROM public.daily_totals"
        ):
            assert isinstance(total, Decimal) and total == total.to_integral_value(), total
            rows.append((day, currency, int(total), int(count)))
    return rows


@dataclass
class TotalsDiff:
    """How `public.daily_totals` differs from the truth.

    `lost_keys`/`doubled_keys`: (day, currency) rows whose count is below/above the truth (a
    missing row counts as lost, a row that should not be there as doubled); `lost`/`doubled`:
    the payments those counts are short/over by. `changed_keys`: right count, wrong total.
    """

    keys: int = 0
    lost_keys: int = 0
    doubled_keys: int = 0
    changed_keys: int = 0
    lost: int = 0
    doubled: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.lost_keys or self.doubled_keys or self.changed_keys)

    def note(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)

    def summary(self) -> str:
        return (
            f"daily_totals: {self.keys} (day, currency) rows expected; differing rows: "
            f"lost={self.lost_keys} doubled={self.doubled_keys} changed={self.changed_keys}; "
            f"payments lost={self.lost} doubled={self.doubled}"
        )


def diff_totals(expected: Totals, rows: list[tuple[date, str, int, int]]) -> TotalsDiff:
    """Compare the rows of `public.daily_totals` with the truth, key by key."""
    diff = TotalsDiff(keys=len(expected))
    actual: Totals = {}
    for day, currency, total, count in rows:
        key = (day, currency)
        if key in actual:  # the primary key forbids it; counted anyway
            diff.doubled_keys += 1
            diff.doubled += count
            diff.note(f"row {key} twice")
            continue
        actual[key] = (total, count)
    for key in expected.keys() | actual.keys():
        want_total, want_count = expected.get(key, (0, 0))
        got = actual.get(key)
        got_total, got_count = got if got is not None else (0, 0)
        if key not in expected:
            # No payments: no row at all, not even one at zero.
            diff.doubled_keys += 1
            diff.doubled += max(got_count, 0)
            diff.lost += max(-got_count, 0)
        elif got is None or got_count < want_count:
            diff.lost_keys += 1
            diff.lost += want_count - got_count
        elif got_count > want_count:
            diff.doubled_keys += 1
            diff.doubled += got_count - want_count
        elif got_total != want_total:
            diff.changed_keys += 1
        if (key in expected) != (got is not None) or (got_total, got_count) != (
            want_total,
            want_count,
        ):
            diff.note(f"{key}: {got} != {expected.get(key)}")
    return diff


def assert_totals_exact(expected: Totals, dsn: str, label: str = "") -> TotalsDiff:
    """Fail unless `public.daily_totals` equals `expected` exactly; print the counts."""
    diff = diff_totals(expected, actual_totals(dsn))
    print(f"{label + ': ' if label else ''}{diff.summary()}")
    assert diff.exact, f"{label}: {diff.summary()}; e.g. {'; '.join(diff.examples)}"
    return diff
