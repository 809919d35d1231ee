"""Synthetic input: atomic files, name order, determinism and agreement with the oracle."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

from onceflow.generate import EDGE_AMOUNTS, GeneratedInput, generate_payments
from onceflow.jobs._payments_rules import Invalid, Payment, parse_payment_line
from tests.support.oracle import expected_outputs, source_lines, visible_files

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FINAL_NAME = re.compile(r"payments-[0-9]{8}T[0-9]{12}-[0-9]{5}\.jsonl")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GeneratedInput]:
    root = tmp_path_factory.mktemp("landing")
    gen = generate_payments(
        root, records=3000, files=7, duplicate_rate=0.2, invalid_rate=0.1, seed=42
    )
    return root, gen


def rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def all_lines(root: Path, gen: GeneratedInput) -> list[tuple[str, int, bytes]]:
    return [
        (rel(root, f), n, raw)
        for f in gen.files
        for n, raw in enumerate(source_lines(f.read_bytes()), start=1)
    ]


def test_ground_truth_agrees_with_oracle(generated: tuple[Path, GeneratedInput]) -> None:
    root, gen = generated
    expected = expected_outputs(root)
    assert len(gen.payments) == 3000
    assert gen.duplicates == 600
    assert len(gen.invalid) == 300
    assert expected.duplicates == gen.duplicates
    assert list(expected.quarantine) == gen.invalid  # same positions, same source order
    assert list(expected.payments) == [p.payment_id for p in gen.payments]  # source order
    for p in gen.payments:
        row = expected.payments[p.payment_id]
        assert row[:6] == (
            p.payment_id,
            p.merchant_id,
            p.customer_id,
            p.amount_cents,
            p.currency,
            p.created_at,
        )
    # Windows that keep name order give the same result however the files are cut.
    names = visible_files(root)
    windowed = expected_outputs(root, windows=[names[:2], names[4:1:-1], names[5:]])
    assert windowed == expected


def test_files_and_names(generated: tuple[Path, GeneratedInput]) -> None:
    root, gen = generated
    entries = sorted(os.listdir(root / "payments"))
    assert entries == [f.name for f in gen.files]  # nothing hidden or temporary left
    assert all(FINAL_NAME.fullmatch(name) for name in entries)
    assert [rel(root, f) for f in gen.files] == visible_files(root)


def test_duplicates_are_spread_and_some_differ(generated: tuple[Path, GeneratedInput]) -> None:
    root, gen = generated
    first: dict[str, tuple[int, Payment]] = {}
    file_index = {rel(root, f): i for i, f in enumerate(gen.files)}
    distances: Counter[str] = Counter()
    differing: Counter[str] = Counter()
    for path, _n, raw in all_lines(root, gen):
        result = parse_payment_line(raw)
        if not isinstance(result, Payment):
            continue
        seen = first.get(result.payment_id)
        if seen is None:
            first[result.payment_id] = (file_index[path], result)
            continue
        gap = file_index[path] - seen[0]
        distances["same file" if gap == 0 else "next files" if gap <= 2 else "far"] += 1
        for field in ("amount_cents", "merchant_id", "customer_id", "created_at"):
            if getattr(result, field) != getattr(seen[1], field):
                differing[field] += 1
        if result == seen[1]:
            differing["identical"] += 1
    assert sum(distances.values()) == gen.duplicates
    assert min(distances[k] for k in ("same file", "next files", "far")) > 20, distances
    assert min(differing[k] for k in ("amount_cents", "merchant_id", "customer_id")) > 50
    assert differing["identical"] > 50, differing


def test_invalid_lines_cover_every_rule(generated: tuple[Path, GeneratedInput]) -> None:
    root, gen = generated
    expected = expected_outputs(root)
    assert expected.reasons is not None
    reasons = set(expected.reasons.values())
    for prefix in (
        "invalid UTF-8",
        "UTF-8 byte order mark",
        "not a JSON object: array",
        "not a JSON object: number",
        "not a JSON object: string",
        "not a JSON object: null",
        "malformed JSON",
        "amount_cents: not an integer literal",
        "amount_cents: out of signed 64-bit range",
        "currency: not three upper-case ASCII letters",
        "currency: not a string",
        "created_at: not an RFC 3339 date-time",
        "created_at: no such date or time",
        "created_at: offset out of range",
        "created_at: not a string",
        "payment_id: empty",
        "merchant_id: empty",
        "customer_id: empty",
        "payment_id: not a string",
        "payment_id: lone surrogate",
        "merchant_id: contains U+0000",
        *(f"missing field: {f}" for f in ("payment_id", "currency", "created_at")),
    ):
        assert any(r.startswith(prefix) for r in reasons), prefix
    # Some invalid lines carry the payment_id of a real payment: never an occurrence.
    real_ids = {p.payment_id.encode() for p in gen.payments}
    reused = [
        raw
        for raw in expected.quarantine.values()
        if (m := re.search(rb'"payment_id":"([^"]*)"', raw)) and m.group(1) in real_ids
    ]
    assert len(reused) > 50


def test_blank_lines_are_ignored(generated: tuple[Path, GeneratedInput]) -> None:
    root, gen = generated
    blank = [(path, n) for path, n, raw in all_lines(root, gen) if parse_payment_line(raw) is None]
    assert len(blank) >= 10
    assert not set(blank) & set(gen.invalid)
    total = len(all_lines(root, gen))
    assert total == len(blank) + len(gen.invalid) + len(gen.payments) + gen.duplicates


def test_line_variety(generated: tuple[Path, GeneratedInput]) -> None:
    _root, gen = generated
    data = b"".join(f.read_bytes() for f in gen.files)
    assert b"}\r\n" in data  # CRLF lines
    offsets = Counter(p.created_at.utcoffset() for p in gen.payments)
    assert set(offsets) == {offsets.most_common(1)[0][0]}  # all converted to UTC
    assert re.search(rb'"created_at":"[^"]*\+05:30"', data)
    assert re.search(rb'"created_at":"[^"]*-08:00"', data)
    assert re.search(rb'"created_at":"[^"]*:[0-9]{2}\.[0-9]{6}Z"', data)
    assert any(not p.customer_id.isascii() for p in gen.payments)
    assert b"\\u00fc" in data  # escaped non-ASCII as well as raw UTF-8
    assert 3 <= len({p.merchant_id for p in gen.payments}) <= 3000 // 50 + len(EDGE_AMOUNTS)
    assert {p.currency for p in gen.payments} == {"USD", "EUR", "GBP", "JPY"}


def test_balances_fit_int64_and_edges_are_isolated(
    generated: tuple[Path, GeneratedInput],
) -> None:
    root, gen = generated
    expected = expected_outputs(root)
    amounts = {p.amount_cents for p in gen.payments}
    assert set(EDGE_AMOUNTS) <= amounts
    for total, count in expected.balances.values():
        assert INT64_MIN <= total <= INT64_MAX
        assert count >= 1
    for edge in (INT64_MAX, INT64_MIN, 2**62, -(10**18)):
        (p,) = [p for p in gen.payments if p.amount_cents == edge]
        assert expected.balances[(p.merchant_id, p.currency)] == (edge, 1)
    assert sum(c for _t, c in expected.balances.values()) == len(gen.payments)


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    def run(root: Path, seed: int) -> tuple[list[bytes], list[Payment], list[tuple[int, int]]]:
        gen = generate_payments(
            root, records=500, files=4, duplicate_rate=0.3, invalid_rate=0.2, seed=seed
        )
        index = {rel(root, f): i for i, f in enumerate(gen.files)}
        return (
            [f.read_bytes() for f in gen.files],
            gen.payments,
            [(index[path], n) for path, n in gen.invalid],
        )

    first = run(tmp_path / "a", 7)
    assert run(tmp_path / "b", 7) == first
    assert run(tmp_path / "c", 8)[0] != first[0]


def test_names_sort_in_creation_order_across_calls(tmp_path: Path) -> None:
    folder = tmp_path / "payments"
    folder.mkdir()
    (folder / ".hidden.jsonl.tmp").write_bytes(b"")  # not input: no effect on names
    first = generate_payments(tmp_path, records=10, files=3, seed=1).files
    second = generate_payments(tmp_path, records=10, files=2, seed=2).files
    # A producer's name from the future: new names still sort after it.
    future = folder / "payments-99991231T235959999999-00000.jsonl"
    future.write_bytes(b"")
    third = generate_payments(tmp_path, records=10, files=2, seed=3).files
    foreign = folder / "zzz.jsonl"
    foreign.write_bytes(b"")
    fourth = generate_payments(tmp_path, records=10, files=2, seed=4).files
    created = [p.name for p in [*first, *second, future, *third, foreign, *fourth]]
    assert sorted(created) == created
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == created
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp") and n != ".hidden.jsonl.tmp"]


def test_small_and_empty_inputs(tmp_path: Path) -> None:
    gen = generate_payments(tmp_path, records=0, files=2, duplicate_rate=0.5, invalid_rate=0.5)
    assert gen.payments == [] and gen.invalid == [] and gen.duplicates == 0
    assert [f.read_bytes() for f in gen.files] == [b"", b""]
    gen = generate_payments(
        tmp_path / "x", records=3, files=5, duplicate_rate=1.0, invalid_rate=1.0, seed=9
    )
    expected = expected_outputs(tmp_path / "x")
    assert list(expected.payments) == [p.payment_id for p in gen.payments]
    assert list(expected.quarantine) == gen.invalid
    assert expected.duplicates == gen.duplicates == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"records": -1, "files": 1},
        {"records": 1, "files": 0},
        {"records": 1, "files": 1, "duplicate_rate": -0.1},
        {"records": 1, "files": 1, "invalid_rate": -1},
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        generate_payments(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_oracle_source_order_and_windows(tmp_path: Path) -> None:
    folder = tmp_path / "payments"
    folder.mkdir()

    def pay(pid: str, amount: int, merchant: str = "m") -> str:
        return (
            f'{{"payment_id":"{pid}","merchant_id":"{merchant}","customer_id":"c",'
            f'"amount_cents":{amount},"currency":"USD","created_at":"2026-01-01T00:00:00Z"}}'
        )

    (folder / "a.jsonl").write_text(f'{pay("p1", 1)}\n\n{{"payment_id":"p2"}}\n{pay("p1", 9)}\n')
    (folder / "b.jsonl").write_text(f"{pay('p2', 2)}\r\n{pay('p3', 3, 'n')}")  # no final newline
    (folder / "c.jsonl").write_text(f"{pay('p3', 30)}\n{pay('p2', 20)}\n")
    (folder / "_skip.jsonl").write_text("garbage\n")
    (folder / ".d.jsonl.tmp").write_text("garbage\n")

    expected = expected_outputs(tmp_path)
    assert {k: v[3] for k, v in expected.payments.items()} == {"p1": 1, "p2": 2, "p3": 3}
    assert expected.payments["p3"][6:] == ("payments/b.jsonl", 2)
    assert expected.quarantine == {("payments/a.jsonl", 3): b'{"payment_id":"p2"}'}
    assert expected.duplicates == 3
    assert expected.balances == {("m", "USD"): (3, 2), ("n", "USD"): (3, 1)}

    # c discovered in an earlier window than b: its lines come first.
    windowed = expected_outputs(
        tmp_path, windows=[["payments/c.jsonl", "payments/a.jsonl"], ["payments/b.jsonl"]]
    )
    assert {k: v[3] for k, v in windowed.payments.items()} == {"p1": 1, "p2": 20, "p3": 30}
    assert windowed.payments["p2"][6:] == ("payments/c.jsonl", 2)
    assert windowed.duplicates == 3


def test_invalid_kinds_are_all_invalid() -> None:
    from onceflow import generate

    fields = {
        "payment_id": '"p-1"',
        "merchant_id": '"m-1"',
        "customer_id": '"c-1"',
        "amount_cents": "1",
        "currency": '"USD"',
        "created_at": '"2026-01-01T00:00:00Z"',
    }
    assert isinstance(parse_payment_line(generate._obj(fields)), Payment)
    for build in generate._INVALID_KINDS:
        raw = build(dict(fields))
        assert isinstance(parse_payment_line(raw), Invalid), raw
        assert b"\n" not in raw and b"\x00" not in raw


def test_oracle_raw_line_keeps_carriage_return(tmp_path: Path) -> None:
    # Only "\n" ends a line, as in the landing source; the "\r" of CRLF stays in the raw line.
    (tmp_path / "payments").mkdir()
    (tmp_path / "payments" / "a.jsonl").write_bytes(b'{"x":1}\r\n \r\n[]')
    expected = expected_outputs(tmp_path)
    assert expected.quarantine == {
        ("payments/a.jsonl", 1): b'{"x":1}\r',
        ("payments/a.jsonl", 3): b"[]",
    }
