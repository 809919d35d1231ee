"""Synthetic `payments` input: atomically written JSON-lines files plus their ground truth."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from onceflow.errors import ConfigurationError
from onceflow.jobs._payments_rules import Payment
from onceflow.storage import Location

_UTC = timezone.utc
CURRENCIES: tuple[str, ...] = ("USD", "EUR", "GBP", "JPY")
# Each edge amount gets a (merchant, currency) pair of its own, so every balance fits int64.
EDGE_AMOUNTS: tuple[int, ...] = (
    2**63 - 1,
    -(2**63),
    0,
    -1,
    2**62,
    -(10**18),
    9_007_199_254_740_993,  # 2**53 + 1: not representable as a double
    2**31,
)
# Realistic offsets only (UTC-12 .. UTC+14); exotic ones are covered by the rules' tests.
_OFFSETS: tuple[tuple[str, int], ...] = tuple(
    (text, minutes * 60)
    for text, minutes in (
        ("Z", 0),
        ("Z", 0),
        ("+00:00", 0),
        ("+01:00", 60),
        ("+05:30", 330),
        ("+05:45", 345),
        ("+09:00", 540),
        ("+14:00", 840),
        ("-03:30", -210),
        ("-08:00", -480),
        ("-12:00", -720),
    )
)
# 2023-12-31 .. 2026-03-31 spans year ends and the 2024 leap day.
_TIME_BASE = datetime(2023, 12, 31, tzinfo=_UTC)
_TIME_SPAN_US = (datetime(2026, 3, 31, tzinfo=_UTC) - _TIME_BASE) // timedelta(microseconds=1)
_TIME_SPAN_DAYS = _TIME_SPAN_US // 86_400_000_000
_FRACTION_STEP: tuple[int, ...] = tuple(10 ** (6 - digits) for digits in range(7))
_CHUNK_LINES = 65_536
_NAME_TS_FORMAT = "%Y%m%dT%H%M%S%f"


@dataclass(frozen=True)
class GeneratedInput:
    """What `generate_payments` wrote, and the outcome the contract implies for it."""

    files: list[Path] | list[Location]  # Locations when written to an object store
    payments: list[Payment]
    invalid: list[tuple[str, int]]
    duplicates: int


def is_input_name(name: str) -> bool:
    """Tells whether a landing file name is job input under the contract.

    Args:
        name: A bare file name.

    Returns:
        True for `*.jsonl` names that neither start with `.` or `_` nor end in `.tmp`.
    """
    return name.endswith(".jsonl") and not name.startswith((".", "_"))


def generate_payments(
    landing_root: Path,
    *,
    records: int,
    files: int,
    duplicate_rate: float = 0.0,
    invalid_rate: float = 0.0,
    seed: int = 0,
    job: str = "payments",
) -> GeneratedInput:
    """Writes synthetic payment files into `landing_root / job`, each one atomically.

    File contents depend only on the arguments (not on time or on files already present);
    file names carry the UTC time and sort after every input file already in the folder.
    The same seed gives the same payment ids, so a second call with the same seed produces
    nothing but duplicates of the first.

    Args:
        landing_root: The landing root folder (`$ONCEFLOW_LANDING`).
        records: Number of distinct valid payments.
        files: Number of files to spread them over (at least 1).
        duplicate_rate: Extra valid lines that repeat an earlier payment_id, as a fraction of
            `records`; some differ from the first occurrence in amount, merchant or customer.
        invalid_rate: Invalid lines as a fraction of `records`, cycling through every rule.
        seed: Seed of the pseudo-random generator.
        job: Job name: the sub-folder and the file name prefix.

    Returns:
        The files written (in name order) and the ground truth for them.

    Raises:
        ConfigurationError: If an argument is out of range.
    """
    if records < 0:
        raise ConfigurationError(f"records must be >= 0, got {records}")
    if files < 1:
        raise ConfigurationError(f"files must be >= 1, got {files}")
    if duplicate_rate < 0 or invalid_rate < 0:
        raise ConfigurationError("duplicate_rate and invalid_rate must be >= 0")
    if not job or "/" in job or "\\" in job or job.startswith((".", "_")):
        raise ConfigurationError(f"bad job name: {job!r}")

    n_dup = round(records * duplicate_rate) if records else 0
    n_invalid = round(records * invalid_rate) if records else 0
    total = records + n_dup + n_invalid
    builder = _Builder(random.Random(seed), records=records, files=files, seed=seed)
    # Millions of small acyclic objects: the cyclic GC would rescan them over and over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        builder.add_originals()
        builder.add_duplicates(n_dup)
        builder.add_invalid(n_invalid)
        builder.add_blank(max(1, total // 200) if total else 0)
        for events in builder.files:
            events.sort()
    finally:
        if gc_was_enabled:
            gc.enable()

    folder = landing_root / job
    folder.mkdir(parents=True, exist_ok=True)
    names = _new_names(folder, job, files)
    written: list[Path] = []
    invalid: list[tuple[str, int]] = []
    for name, events in zip(names, builder.files, strict=True):
        rel = f"{job}/{name}"
        lines: list[bytes] = []
        for lineno, (_key, _seq, is_invalid, data) in enumerate(events, start=1):
            lines.append(data)
            if is_invalid:
                invalid.append((rel, lineno))
        written.append(_write_atomically(folder, name, lines))
        events.clear()
    _fsync_dir(folder)
    return GeneratedInput(
        files=written, payments=builder.payments, invalid=invalid, duplicates=n_dup
    )


def generate_payments_into(
    landing: Location, *, job: str = "payments", **options: Any
) -> GeneratedInput:
    """`generate_payments` into a landing location: a local folder, or an object store where
    each file is written with one PUT (visible whole or not at all), in name order.

    Args:
        landing: The landing root (`Settings.landing`).
        job: The job whose folder receives the files.
        options: `generate_payments`'s other arguments.
    """
    if landing.is_local:
        return generate_payments(landing.path, job=job, **options)
    with tempfile.TemporaryDirectory(prefix="onceflow-generate-") as tmp:
        made = generate_payments(Path(tmp), job=job, **options)
        uploaded = []
        for path in made.files:
            target = landing / job / path.name
            target.write_bytes(path.read_bytes())
            uploaded.append(target)
    return replace(made, files=uploaded)


# One line of a file: (position key, creation sequence, is_invalid, bytes with terminator).
_Event = tuple[float, int, bool, bytes]


class _Builder:
    """Builds the lines of every file in memory, in creation order, with position keys."""

    def __init__(self, rng: random.Random, *, records: int, files: int, seed: int) -> None:
        self.rng = rng
        self.records = records
        self.n_files = files
        self.seed = seed
        self.files: list[list[_Event]] = [[] for _ in range(files)]
        self.payments: list[Payment] = []
        self.positions: list[tuple[int, int]] = []  # payment index -> (file, key)
        self.file_sizes: list[int] = [0] * files
        self.seq = 0
        self.n_customers = max(1, records * 2)
        n_merchants = max(3, records // 50)
        self.merchants = [f"m-{k:05d}" for k in range(n_merchants)]
        # Bounds every |amount| so that records * max |amount| stays far below 2**63.
        self.max_large = max(1_000_000, min(10**12, 2**62 // max(records, 1)))
        # Text of every local day (one either side of the span, for offsets) and time of day:
        # formatting datetimes per line would dominate the run time.
        self.day_text = [
            (_TIME_BASE + timedelta(days=day)).strftime("%Y-%m-%d")
            for day in range(-1, _TIME_SPAN_DAYS + 2)
        ]
        self.clock_text = [
            f"{h:02d}:{m:02d}:{sec:02d}" for h in range(24) for m in range(60) for sec in range(60)
        ]

    def _push(self, file: int, key: float, data: bytes, *, is_invalid: bool = False) -> None:
        self.files[file].append((key, self.seq, is_invalid, data))
        self.seq += 1

    def _amount(self) -> int:
        """A mostly small amount; some refunds, zeros and large values."""
        r = self.rng.random()
        if r < 0.05:
            return -1 - int(self.rng.random() * 100_000)
        if r < 0.052:
            return 1_000_000 + int(self.rng.random() * (self.max_large - 999_999))
        if r < 0.055:
            return 0
        return 1 + int(self.rng.random() * 500_000)

    def _customer(self, index: int) -> tuple[str, str]:
        """Returns the customer id and its JSON text (sometimes non-ASCII, sometimes escaped)."""
        r = self.rng.random()
        if r < 0.01:
            value = f"c-Zoë-東京-{index}"
            return value, _json_str(value, ascii_only=False)
        if r < 0.02:
            value = f"c-Müller-{index}"
            return value, _json_str(value, ascii_only=True)
        value = f"c-{int(self.rng.random() * self.n_customers):08d}"
        return value, f'"{value}"'

    def _created_at(self) -> tuple[datetime, str]:
        """A UTC instant and its text in a random offset with 0 to 6 fractional digits."""
        rng = self.rng
        digits = int(rng.random() * 7)
        step = _FRACTION_STEP[digits]
        total_us = int(rng.random() * _TIME_SPAN_US) // step * step
        offset_text, offset_s = _OFFSETS[int(rng.random() * len(_OFFSETS))]
        seconds, micro = divmod(total_us, 1_000_000)
        day, clock = divmod(seconds + offset_s, 86_400)
        text = f"{self.day_text[day + 1]}T{self.clock_text[clock]}"
        if digits:
            text += f".{micro // step:0{digits}d}"
        return _TIME_BASE + timedelta(0, seconds, micro), text + offset_text

    def _render(
        self,
        payment_id: str,
        merchant_id: str,
        customer_json: str,
        amount: int,
        currency: str,
        created_text: str,
    ) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.9:
            text = (
                f'{{"payment_id":"{payment_id}","merchant_id":"{merchant_id}",'
                f'"customer_id":{customer_json},"amount_cents":{amount},'
                f'"currency":"{currency}","created_at":"{created_text}"}}'
            )
        else:
            text = (
                f'{{"created_at": "{created_text}", "currency": "{currency}", '
                f'"amount_cents": {amount}, "customer_id": {customer_json}, '
                f'"merchant_id": "{merchant_id}", "payment_id": "{payment_id}", '
                f'"channel": "web", "meta": {{"retry": {int(r * 100) % 3}, "score": 0.5}}}}'
            )
        r = rng.random()
        if r < 0.03:
            return (text + "\r\n").encode()
        if r < 0.04:
            return ("  " + text + " \t\n").encode()
        return (text + "\n").encode()

    def add_originals(self) -> None:
        """Adds every distinct payment, in index order, spread evenly over the files."""
        rng = self.rng
        records = self.records
        edge_at = {
            index: k
            for k, index in enumerate(
                rng.sample(range(records), min(len(EDGE_AMOUNTS), records // 10))
            )
        }
        merchants = self.merchants
        for i in range(records):
            file = i * self.n_files // records
            key = self.file_sizes[file]
            self.file_sizes[file] = key + 1
            payment_id = f"p{self.seed}-{i:09d}"
            customer, customer_json = self._customer(i)
            created_at, created_text = self._created_at()
            edge = edge_at.get(i)
            if edge is None:
                merchant = merchants[int(rng.random() * len(merchants))]
                currency = CURRENCIES[int(rng.random() * len(CURRENCIES))]
                amount = self._amount()
            else:
                merchant = f"m-edge-{self.seed}-{edge:02d}"
                currency = CURRENCIES[edge % len(CURRENCIES)]
                amount = EDGE_AMOUNTS[edge]
            self.payments.append(
                Payment(payment_id, merchant, customer, amount, currency, created_at)
            )
            self.positions.append((file, key))
            data = self._render(payment_id, merchant, customer_json, amount, currency, created_text)
            self._push(file, key, data)

    def add_duplicates(self, count: int) -> None:
        """Adds valid lines repeating an earlier payment_id, always after its first one."""
        rng = self.rng
        last = self.n_files - 1
        for d in range(count):
            placement = d % 3
            if placement == 2:
                # Far later: an early payment repeated in the last file.
                index = rng.randrange(max(1, self.records // 10))
            else:
                index = rng.randrange(self.records)
            src_file, src_key = self.positions[index]
            if placement == 0 or src_file == last:
                file = src_file
                key = src_key + 0.5 + rng.random() * (self.file_sizes[file] - src_key)
            else:
                file = last if placement == 2 else min(last, src_file + 1 + rng.randrange(2))
                key = rng.random() * max(1, self.file_sizes[file])
            p = self.payments[index]
            merchant, amount, currency = p.merchant_id, p.amount_cents, p.currency
            customer_json = _json_str(p.customer_id, ascii_only=rng.random() < 0.5)
            change = d % 5
            if change == 0:
                amount = self._amount()
                while amount == p.amount_cents:
                    amount = self._amount()
            elif change == 1:
                while merchant == p.merchant_id:
                    merchant = self.merchants[int(rng.random() * len(self.merchants))]
            elif change == 2:
                customer_json = f'"c-retry-{d}"'
            _, created_text = self._created_at()
            if change >= 3:
                created_text = _utc_text(p.created_at)
            data = self._render(
                p.payment_id,
                merchant,
                customer_json,
                amount,
                currency,
                created_text,
            )
            self._push(file, key, data)

    def add_invalid(self, count: int) -> None:
        """Adds invalid lines anywhere, cycling through `_INVALID_KINDS`."""
        rng = self.rng
        for k in range(count):
            if self.records and rng.random() < 0.5:
                # An invalid line never counts as an occurrence, even of a real payment_id.
                payment_id = self.payments[rng.randrange(self.records)].payment_id
            else:
                payment_id = f"p{self.seed}-bad-{k:08d}"
            _, created_text = self._created_at()
            fields = {
                "payment_id": f'"{payment_id}"',
                "merchant_id": f'"{self.merchants[k % len(self.merchants)]}"',
                "customer_id": f'"c-{k:08d}"',
                "amount_cents": str(self._amount()),
                "currency": f'"{CURRENCIES[k % len(CURRENCIES)]}"',
                "created_at": f'"{created_text}"',
            }
            data = _INVALID_KINDS[k % len(_INVALID_KINDS)](fields) + b"\n"
            file = rng.randrange(self.n_files)
            self._push(file, rng.random() * max(1, self.file_sizes[file]), data, is_invalid=True)

    def add_blank(self, count: int) -> None:
        """Adds empty and white-space-only lines anywhere."""
        rng = self.rng
        for k in range(count):
            file = rng.randrange(self.n_files)
            data = _BLANK_LINES[k % len(_BLANK_LINES)]
            self._push(file, rng.random() * max(1, self.file_sizes[file]), data)


_BLANK_LINES: tuple[bytes, ...] = (b"\n", b"   \n", b"\t\n", b"\r\n", b" \t \n")


def _json_str(value: str, *, ascii_only: bool) -> str:
    """JSON text of a string, with non-ASCII characters as `\\u` escapes or as they are."""
    return json.dumps(value, ensure_ascii=ascii_only)


def _utc_text(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _obj(fields: dict[str, str]) -> bytes:
    return ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode()


def _with(**changes: str) -> Callable[[dict[str, str]], bytes]:
    def build(fields: dict[str, str]) -> bytes:
        return _obj({**fields, **changes})

    return build


def _without(name: str) -> Callable[[dict[str, str]], bytes]:
    def build(fields: dict[str, str]) -> bytes:
        return _obj({k: v for k, v in fields.items() if k != name})

    return build


def _created(value: str) -> Callable[[dict[str, str]], bytes]:
    return _with(created_at=f'"{value}"')


# One builder per rule of the contract; generated invalid lines cycle through them.
_INVALID_KINDS: tuple[Callable[[dict[str, str]], bytes], ...] = (
    lambda f: _obj({**f, "customer_id": '"c-@@"'}).replace(b"@@", b"\xff\xfe"),
    lambda f: _obj({**f, "merchant_id": '"m-@@"'}).replace(b"@@", b"\xed\xa0\x80"),
    lambda f: _obj({**f, "customer_id": '"c-@@"'}).replace(b"@@", b"\xc3"),
    lambda f: b"\xef\xbb\xbf" + _obj(f),
    lambda f: ("[" + ",".join(f.values()) + "]").encode(),
    lambda f: b"12345",
    lambda f: b'"payment"',
    lambda f: b"null",
    lambda f: _obj(f)[:-20],
    lambda f: _obj(f) + b" trailing",
    lambda f: _obj(f)[:-1] + b",}",
    _with(amount_cents="NaN"),
    _with(amount_cents="1.5"),
    _with(amount_cents="1e3"),
    _with(amount_cents="100.0"),
    _with(amount_cents="true"),
    _with(amount_cents='"100"'),
    _with(amount_cents=str(2**63)),
    _with(amount_cents=str(-(2**63) - 1)),
    _with(amount_cents="null"),
    _with(currency='"usd"'),
    _with(currency='"USDX"'),
    _with(currency='"US"'),
    _with(currency="840"),
    _created("2026-02-30T10:00:00Z"),
    _created("2026-03-04T24:00:00Z"),
    _created("2026-03-04T23:59:60Z"),
    _created("2026-03-04t05:06:07Z"),
    _created("2026-03-04T05:06:07z"),
    _created("2026-03-04 05:06:07Z"),
    _created("2026-03-04T05:06:07"),
    _created("2026-03-04T05:06:07.1234567Z"),
    _created("2026-03-04T05:06:07+0530"),
    _created("2026-03-04T05:06Z"),
    _created("2026-03-04T05:06:07+24:00"),
    _with(created_at="1772600767"),
    _without("payment_id"),
    _without("merchant_id"),
    _without("customer_id"),
    _without("amount_cents"),
    _without("currency"),
    _without("created_at"),
    _with(payment_id='""'),
    _with(merchant_id='""'),
    _with(customer_id='""'),
    _with(payment_id="12345"),
    _with(payment_id='"\\ud800"'),
    _with(merchant_id='"m-\\u0000"'),
    _with(customer_id='"c-\x01"'),
    # Repeated key: the last value counts, and it is not an integer literal.
    lambda f: _obj(f)[:-1] + b',"amount_cents":"5"}',
    lambda f: b"{}",
)


def _new_names(folder: Path, job: str, count: int) -> list[str]:
    """Returns `count` new file names, in order, all sorting after every input file there."""
    width = max(5, len(str(count - 1)))
    latest = max((n for n in os.listdir(folder) if is_input_name(n)), default="")
    stamp = datetime.now(_UTC)
    prefix = f"{job}-{stamp.strftime(_NAME_TS_FORMAT)}-"
    if latest and f"{prefix}{0:0{width}d}.jsonl" <= latest:
        # The clock did not move (or went back): continue after the latest stamp of ours.
        m = re.fullmatch(rf"{re.escape(job)}-([0-9]{{8}}T[0-9]{{12}})-[0-9]+\.jsonl", latest)
        try:
            if m is None:
                raise ValueError(latest)
            bumped = datetime.strptime(m.group(1), _NAME_TS_FORMAT) + timedelta(microseconds=1)
            prefix = f"{job}-{bumped.strftime(_NAME_TS_FORMAT)}-"
        except (ValueError, OverflowError):
            pass
        if f"{prefix}{0:0{width}d}.jsonl" <= latest:
            # A foreign name sorts after ours: extend it; "~" sorts after every name char used.
            prefix = f"{latest[: -len('.jsonl')]}~{stamp.strftime(_NAME_TS_FORMAT)}-"
    return [f"{prefix}{seq:0{width}d}.jsonl" for seq in range(count)]


def _write_atomically(folder: Path, name: str, lines: list[bytes]) -> Path:
    """Writes `lines` to a hidden temporary file, fsyncs it and renames it to `name`."""
    tmp = folder / f".{name}.tmp"
    final = folder / name
    try:
        with open(tmp, "wb") as fh:
            for start in range(0, len(lines), _CHUNK_LINES):
                fh.write(b"".join(lines[start : start + _CHUNK_LINES]))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def _fsync_dir(folder: Path) -> None:
    """Makes the renames durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
