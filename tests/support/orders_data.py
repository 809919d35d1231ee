"""Input and plain-Python truth for the user job `orders` (tests/support/user_project).

The CSV files are written line by line from `FILES`, where every line says what it is: the
header, a blank line, a valid order (its values), or an invalid record (the start of its
reason). The expected sink state follows from that alone, with the user's transform
re-stated in Python: customer trimmed of spaces and lower-cased, the window id added, and
upsert by `order_id` so the row of the latest window wins.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

USER_PROJECT = Path(__file__).resolve().parent / "user_project"
JOB = "orders"
FOLDER = "orders"

UTC = timezone.utc


@dataclass(frozen=True)
class Order:
    order_id: str
    customer: str
    amount_cents: int | None
    ordered_at: datetime


@dataclass(frozen=True)
class Bad:
    reason_starts: str


HEADER = "order_id,customer,amount_cents,ordered_at"
Line = tuple[str, "Order | Bad | None"]  # text, and what it is (None: header or blank)

# One file per window when run with --max-files-per-window 1 (files enter in name order).
FILES: dict[str, list[Line]] = {
    "orders-001.csv": [
        (HEADER, None),
        ("o1,Alice,1250,2024-05-01T10:00:00Z", Order("o1", "Alice", 1250, datetime(2024, 5, 1, 10, tzinfo=UTC))),
        ("o2, Bob ,300,2024-05-01T11:30:00+02:00", Order("o2", " Bob ", 300, datetime(2024, 5, 1, 9, 30, tzinfo=UTC))),
        ("o3,Carol,12.5,2024-05-01T12:00:00Z", Bad("amount_cents:")),
        ("", None),
        ("o4,Dan,700,2024-05-01 13:00:00", Bad("ordered_at:")),
    ],
    "orders-002.csv": [
        (HEADER, None),
        ("o5,Eve,999,2024-05-02T08:00:00Z", Order("o5", "Eve", 999, datetime(2024, 5, 2, 8, tzinfo=UTC))),
        ("o6,Frank,100", Bad("expected 4 fields, got 3")),
        ('"o7","Grace, Ltd",4200,2024-05-02T09:00:00.250Z', Order("o7", "Grace, Ltd", 4200, datetime(2024, 5, 2, 9, 0, 0, 250000, tzinfo=UTC))),
    ],
    # Columns in another order (matched by the header); o2 comes again and must win.
    "orders-003.csv": [
        ("ordered_at,order_id,amount_cents,customer", None),
        ("2024-05-03T10:00:00Z,o2,350,BOB", Order("o2", "BOB", 350, datetime(2024, 5, 3, 10, tzinfo=UTC))),
        ("2024-05-03T11:00:00Z,o8,,Heidi", Order("o8", "Heidi", None, datetime(2024, 5, 3, 11, tzinfo=UTC))),
        ("not-a-time,o9,10,Ivan", Bad("ordered_at:")),
    ],
}  # fmt: skip

OrderRow = tuple[str, str, int | None, datetime, int]
QuarantineRow = tuple[str, int, str, int, str]  # job, window, file, line, raw text


def write_orders(landing: Path, names: Sequence[str] | None = None) -> list[str]:
    """Write the `FILES` (or those named) under `landing/orders`; their paths, landing-relative."""
    folder = landing / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or sorted(FILES):
        text = "".join(f"{line}\n" for line, _ in FILES[name])
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.rename(folder / name)
        written.append(f"{FOLDER}/{name}")
    return written


def expected_orders(windows: Sequence[Sequence[str]]) -> list[OrderRow]:
    """`public.orders` after the given windows (file names per window, in window order)."""
    table: dict[str, OrderRow] = {}
    for window_id, names in enumerate(windows, start=1):
        for name in names:
            for _, what in FILES[name]:
                if isinstance(what, Order):
                    table[what.order_id] = (
                        what.order_id,
                        what.customer.strip(" ").lower(),
                        what.amount_cents,
                        what.ordered_at,
                        window_id,
                    )
    return sorted(table.values())


def expected_quarantine(
    windows: Sequence[Sequence[str]],
) -> list[tuple[QuarantineRow, str]]:
    """The quarantine rows of `orders` (and the start of each reason) for the given windows."""
    rows = []
    for window_id, names in enumerate(windows, start=1):
        for name in names:
            for number, (text, what) in enumerate(FILES[name], start=1):
                if isinstance(what, Bad):
                    rows.append(
                        ((JOB, window_id, f"{FOLDER}/{name}", number, text), what.reason_starts)
                    )
    return sorted(rows)


def actual_orders(dsn: str) -> list[OrderRow]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT order_id, customer, amount_cents, ordered_at, window_id FROM public.orders"
        ).fetchall()
    return sorted(tuple(r) for r in rows)  # type: ignore[misc]


def actual_quarantine(dsn: str, job: str = JOB) -> list[tuple[QuarantineRow, str]]:
    """The job's quarantine rows, each with its full reason."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT job, window_id, source_file, source_line, raw_line, reason"
            " FROM onceflow.quarantine WHERE job = %s",
            (job,),
        ).fetchall()
    return sorted(((j, int(w), f, int(n), t), r) for j, w, f, n, t, r in rows)


def assert_orders_exact(dsn: str, windows: Sequence[Sequence[str]]) -> None:
    """`public.orders` and the job's quarantine rows are exactly what `windows` give."""
    orders, want = actual_orders(dsn), expected_orders(windows)
    assert orders == want, f"public.orders:\n  actual   {orders}\n  expected {want}"
    actual = actual_quarantine(dsn)
    expected = expected_quarantine(windows)
    rows, want_rows = [row for row, _ in actual], [row for row, _ in expected]
    assert rows == want_rows, f"quarantine:\n  actual   {rows}\n  expected {want_rows}"
    for (row, reason), (_, starts) in zip(actual, expected, strict=True):
        assert reason.startswith(starts), (row, reason)


def one_file_per_window() -> list[list[str]]:
    return [[name] for name in sorted(FILES)]


@contextmanager
def user_project_on_path() -> Iterator[Any]:
    """The user's module, imported from its folder the way onceflow's registry finds it; the
    folder leaves `sys.path` and the module `sys.modules` afterwards, so tests that prove how
    the registry finds it start clean."""
    saved_path = list(sys.path)
    loaded = "orders_jobs" in sys.modules
    sys.path.insert(0, str(USER_PROJECT))
    try:
        import orders_jobs

        yield orders_jobs
    finally:
        sys.path[:] = saved_path
        if not loaded:
            sys.modules.pop("orders_jobs", None)
