"""Plain-Python expected outputs of the `payments` job, computed from the files on disk."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from onceflow.jobs._payments_rules import Invalid, parse_payment_line

# payment_id, merchant_id, customer_id, amount_cents, currency, created_at (UTC), file, line
PaymentRow = tuple[str, str, str, int, str, datetime, str, int]


@dataclass(frozen=True)
class Expected:
    """What every sink must hold after the job has processed the given input."""

    payments: dict[str, PaymentRow]
    balances: dict[tuple[str, str], tuple[int, int]]
    quarantine: dict[tuple[str, int], bytes]
    duplicates: int
    reasons: dict[tuple[str, int], str] | None = None


def visible_files(landing_root: Path, job: str = "payments") -> list[str]:
    """Input files of `job` under the contract, as paths relative to `landing_root`, by name."""
    folder = landing_root / job
    names = sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file()
        and p.name.endswith(".jsonl")
        and not p.name.startswith((".", "_"))
        and not p.name.endswith(".tmp")
    )
    return [f"{job}/{name}" for name in names]


def source_lines(data: bytes) -> list[bytes]:
    """Splits a file into its raw lines, without the `\\n` terminator.

    Only `\\n` ends a line, so a CRLF line keeps its `\\r` (as the landing source reads it;
    validation ignores it). A final line without a terminator is a line; the empty tail after
    a final newline is not.
    """
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def expected_outputs(
    landing_root: Path, job: str = "payments", windows: list[list[str]] | None = None
) -> Expected:
    """Computes the contract's outputs for the input files, in source order.

    Args:
        landing_root: The landing root; file paths are relative to it.
        job: Job name (its folder under `landing_root`), used when `windows` is None.
        windows: The files of each window, in window order, as relative paths; within a window
            files are taken in name order. None means one window of every visible file.

    Returns:
        Payments (first valid occurrence of each payment_id), balances, quarantined raw lines
        (with their reasons in `reasons`) and the number of duplicate lines dropped.
    """
    if windows is None:
        windows = [visible_files(landing_root, job)]
    payments: dict[str, PaymentRow] = {}
    quarantine: dict[tuple[str, int], bytes] = {}
    reasons: dict[tuple[str, int], str] = {}
    duplicates = 0
    for window in windows:
        for rel in sorted(window):
            data = (landing_root / rel).read_bytes()
            for lineno, raw in enumerate(source_lines(data), start=1):
                result = parse_payment_line(raw)
                if result is None:
                    continue
                if isinstance(result, Invalid):
                    quarantine[(rel, lineno)] = raw
                    reasons[(rel, lineno)] = result.reason
                elif result.payment_id in payments:
                    duplicates += 1
                else:
                    payments[result.payment_id] = (
                        result.payment_id,
                        result.merchant_id,
                        result.customer_id,
                        result.amount_cents,
                        result.currency,
                        result.created_at,
                        rel,
                        lineno,
                    )
    balances: dict[tuple[str, str], tuple[int, int]] = {}
    for row in payments.values():
        key = (row[1], row[4])
        total, count = balances.get(key, (0, 0))
        balances[key] = (total + row[3], count + 1)
    return Expected(payments, balances, quarantine, duplicates, reasons)
