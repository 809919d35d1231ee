"""The vectorised parse of compact lines gives exactly what the per-line parser gives."""

from __future__ import annotations

import random
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from onceflow.generate import generate_payments
from onceflow.jobs._payments_fast import parse_canonical
from onceflow.jobs._payments_rules import Payment, parse_payment_line
from onceflow.jobs.payments import _parse_batches, _raw_text
from tests.support.oracle import source_lines

RAW_SCHEMA = pa.schema(
    [
        ("_file_idx", pa.int32()),
        ("_source_file", pa.string()),
        ("_source_line", pa.int64()),
        ("_raw", pa.binary()),
    ]
)
LINE = (
    '{{"payment_id":"{id}","merchant_id":"m-1","customer_id":"c-1","amount_cents":{amount},'
    '"currency":"{currency}","created_at":"{created}"}}'
)


def compact(
    id: str = "p-1", amount: str = "5", currency: str = "USD", created: str = "2023-01-01T00:00:00Z"
) -> bytes:
    return LINE.format(id=id, amount=amount, currency=currency, created=created).encode()


CREATED = [
    "2024-02-29T00:00:00Z",
    "2023-02-29T00:00:00Z",
    "2023-02-30T00:00:00Z",
    "2023-04-31T12:00:00Z",
    "2023-13-01T00:00:00Z",
    "2023-00-10T00:00:00Z",
    "2023-01-00T00:00:00Z",
    "2023-01-01T24:00:00Z",
    "2023-01-01T23:60:00Z",
    "2023-01-01T23:59:60Z",
    "0000-01-01T00:00:00Z",
    "0001-01-01T00:00:00+00:01",
    "0001-01-01T00:00:00-00:01",
    "9999-12-31T23:59:59-00:01",
    "9999-12-31T23:59:59+00:01",
    "0002-03-04T05:06:07.1+23:59",
    "0999-03-04T05:06:07.123456-23:59",
    "2023-01-01T00:00:00+24:00",
    "2023-01-01T00:00:00+23:60",
    "2023-01-01T00:00:00.1234567Z",
    "2023-01-01T00:00:00.Z",
    "2023-01-01t00:00:00Z",
    "2023-01-01T00:00:00z",
    "2023-01-01T00:00:00",
    "2023-01-01T00:00:00.000001+05:45",
    "2023-01-01T00:00:00.5-03:30",
    "1900-02-29T00:00:00Z",
    "2000-02-29T00:00:00Z",
    "2023-06-30T23:59:59.999999-00:00",
]
AMOUNTS = [
    "0",
    "-0",
    "-1",
    "999999999999999999",
    "-999999999999999999",
    "9223372036854775807",
    "-9223372036854775808",
    "9223372036854775808",
    "01",
    "1.0",
    "1e3",
    "true",
    '"5"',
    "-",
]
EDGES = [
    *(compact(created=c) for c in CREATED),
    *(compact(amount=a) for a in AMOUNTS),
    *(compact(currency=c) for c in ("usd", "US", "USDD", "ÀBC")),
    *(
        w + compact() + w
        for w in (b" ", b"\t", b"\r", b"\x0b", b"\x0c", b"\n", b"\xc2\xa0", b"\x00")
    ),
    *(compact(id=i) for i in ("", " ", "a b", "\\u0041", "é", '\\"', "x\x7f", "x\x1f", "\\u0000")),
    compact().replace(b"}", b',"payment_id":"q"}'),
    compact().replace(b"}", b',"extra":1}'),
    compact().replace(b":", b": "),
    compact()[:-1],
    b"",
    b"   ",
    b"\r",
]


def batch_of(lines: list[bytes]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "_file_idx": [0] * len(lines),
            "_source_file": ["f"] * len(lines),
            "_source_line": list(range(1, len(lines) + 1)),
            "_raw": lines,
        },
        schema=RAW_SCHEMA,
    )


def one_by_one(lines: list[bytes]) -> list[tuple[Any, ...]]:
    """What the per-line parser makes of `lines`, as rows of the parsed batch."""
    rows: list[tuple[Any, ...]] = []
    for number, raw in enumerate(lines, start=1):
        result = parse_payment_line(raw)
        if result is None:
            continue
        if isinstance(result, Payment):
            ids = (result.payment_id, result.merchant_id, result.customer_id)
            rest = (result.amount_cents, result.currency, result.created_at)
            rows.append((number, *ids, *rest, None, None))
        else:
            rows.append((number, *[None] * 6, _raw_text(raw), result.reason))
    return rows


def parsed(lines: list[bytes]) -> list[tuple[Any, ...]]:
    table = pa.Table.from_batches(list(_parse_batches(iter([batch_of(lines)]))))
    names = ["_source_line", "payment_id", "merchant_id", "customer_id", "amount_cents"]
    names += ["currency", "created_at", "_raw_text", "_reason"]
    return [tuple(row[n] for n in names) for row in table.to_pylist()]


def taken_fast(lines: list[bytes]) -> list[bool]:
    mask, _ = parse_canonical(pa.array(lines, pa.binary()))
    return mask.to_pylist()


def test_edge_lines_parse_as_one_by_one() -> None:
    assert parsed(EDGES) == one_by_one(EDGES)
    fast = dict(zip(EDGES, taken_fast(EDGES), strict=True))
    # The path is taken where it can be, and not where it cannot prove the answer.
    assert fast[compact(created="2024-02-29T00:00:00Z")]
    assert fast[compact(created="2023-01-01T00:00:00.000001+05:45")]
    assert fast[compact(amount="-999999999999999999")]
    assert fast[b"\r" + compact() + b"\r"]
    assert not fast[compact(created="2023-02-29T00:00:00Z")]
    assert not fast[compact(created="0001-01-01T00:00:00+00:01")]
    assert not fast[compact(amount="9223372036854775807")]
    assert not fast[compact(id="\\u0041")]


def test_generated_input_parses_as_one_by_one(tmp_path: Path) -> None:
    gen = generate_payments(
        tmp_path, records=4000, files=2, duplicate_rate=0.2, invalid_rate=0.1, seed=7
    )
    lines = [raw for f in gen.files for raw in source_lines(f.read_bytes())]
    assert parsed(lines) == one_by_one(lines)
    # Most generated lines are compact: the test covers the fast path, not only the slow one.
    assert sum(taken_fast(lines)) > len(lines) // 2


@pytest.mark.parametrize("seed", range(4))
def test_mutated_compact_lines_parse_as_one_by_one(seed: int) -> None:
    """Random single-character changes to compact lines, most of them kept in shape, so that
    every check of the fast path meets values on both sides of it."""
    rng = random.Random(seed)
    alphabet = '0123456789+-:.TZ ABCxyz"\\é\x00\x1f'
    lines = []
    for _ in range(3000):
        when = datetime(rng.randrange(1, 10000), rng.randrange(1, 13), rng.randrange(1, 29))
        created = when.strftime("%Y-%m-%dT") + rng.choice(
            ["23:59:59Z", "00:00:00.5+05:45", "12:30:00-23:59", "01:02:03.123456-00:00"]
        )
        text = compact(
            id=f"p-{rng.randrange(10**6)}",
            amount=str(rng.randrange(-(10**18), 10**18)),
            created=created,
        ).decode()
        position = rng.randrange(len(text))
        text = text[:position] + rng.choice(alphabet) + text[position + 1 :]
        lines.append(text.encode("utf-8", errors="surrogatepass"))
    assert parsed(lines) == one_by_one(lines)
    taken = sum(taken_fast(lines))
    assert 0 < taken < len(lines)


@pytest.mark.parametrize(
    "lines",
    [[], [b""], [compact()], [compact(amount="1.5")], [compact(), b"", compact(amount="x")]],
    ids=["empty", "blank", "fast-only", "slow-only", "mixed"],
)
def test_batches_of_one_kind(lines: list[bytes]) -> None:
    assert parsed(lines) == one_by_one(lines)
