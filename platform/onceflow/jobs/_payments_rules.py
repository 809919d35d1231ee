"""Validation of one `payments` input line against the fixed contract, in plain Python."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

PAYMENT_FIELDS: tuple[str, ...] = (
    "payment_id",
    "merchant_id",
    "customer_id",
    "amount_cents",
    "currency",
    "created_at",
)

INT64_MIN: int = -(2**63)
INT64_MAX: int = 2**63 - 1

_STRING_FIELDS: tuple[str, ...] = ("payment_id", "merchant_id", "customer_id")
_UTF8_BOM = b"\xef\xbb\xbf"
_MISSING = object()
_UTC = timezone.utc

# Explicit [0-9] and [A-Z]: `\d` and re.IGNORECASE would also accept non-ASCII digits/letters.
_CURRENCY_RE = re.compile(r"[A-Z]{3}")
_CREATED_AT_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,6}))?"
    r"(Z|[+-][0-9]{2}:[0-9]{2})"
)
# Offset string -> timedelta to add to the local time to get UTC; at most 2 * 24 * 60 entries.
_OFFSETS: dict[str, timedelta] = {}


@dataclass(frozen=True, slots=True)
class Payment:
    """One valid payment line."""

    payment_id: str
    merchant_id: str
    customer_id: str
    amount_cents: int
    currency: str
    created_at: datetime  # aware, in UTC


@dataclass(frozen=True, slots=True)
class Invalid:
    """A line that breaks the contract; it goes to quarantine."""

    reason: str


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN/Infinity/-Infinity, which are not JSON.
    raise ValueError(f"{name} is not valid JSON")


_decoder = json.JSONDecoder(parse_constant=_reject_constant)
_decode = _decoder.decode


def parse_created_at(s: str) -> datetime | None:
    """Parses a contract `created_at` value.

    Args:
        s: RFC 3339 date-time with an upper-case `T`, seconds, at most 6 fractional digits and
            `Z` or a `±HH:MM` offset.

    Returns:
        The instant as an aware datetime in UTC, or None if `s` breaks a rule or names a
        date-time that does not exist (or cannot be represented in UTC).
    """
    result = _parse_created_at(s)
    return result if type(result) is datetime else None


def _parse_created_at(s: str) -> datetime | str:
    """Returns the UTC instant of `s`, or the reason it is invalid."""
    m = _CREATED_AT_RE.fullmatch(s)
    if m is None:
        return "created_at: not an RFC 3339 date-time"
    year, month, day, hour, minute, second, frac, offset = m.groups()
    try:
        local = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            int(frac.ljust(6, "0")) if frac else 0,
            _UTC,
        )
    except ValueError:
        return "created_at: no such date or time"
    if offset == "Z":
        return local
    to_utc = _OFFSETS.get(offset)
    if to_utc is None:
        hours = int(offset[1:3])
        minutes = int(offset[4:6])
        if hours > 23 or minutes > 59:
            return "created_at: offset out of range"
        to_utc = timedelta(hours=hours, minutes=minutes)
        if offset[0] == "+":
            to_utc = -to_utc
        _OFFSETS[offset] = to_utc
    try:
        return local + to_utc
    except OverflowError:
        return "created_at: out of range in UTC"


def _check_id(name: str, value: object) -> str | None:
    """Returns the reason `value` is not a valid id string, or None if it is."""
    if type(value) is not str:
        return f"{name}: not a string"
    if not value:
        return f"{name}: empty"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name}: lone surrogate escape, not valid Unicode"
    # PostgreSQL text cannot hold U+0000; accepting it would wedge the sink forever.
    if "\x00" in value:
        return f"{name}: contains U+0000"
    return None


def parse_payment_line(raw: bytes) -> Payment | Invalid | None:
    """Validates one input line.

    Args:
        raw: The line's bytes, with or without its `\\n` / `\\r\\n` terminator.

    Returns:
        None for a blank line (empty or only ASCII white space), which is ignored; the
        `Payment` for a valid line; otherwise `Invalid` with a short human-readable reason.
        ASCII white space around the object is allowed. Fields other than the six are
        ignored. A key that appears twice in the object takes its last value (Python's
        `json` behaviour).
    """
    line = raw.strip()
    if not line:
        return None
    if line.startswith(_UTF8_BOM):
        return Invalid("UTF-8 byte order mark at start of line")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return Invalid("invalid UTF-8")
    try:
        obj = _decode(text)
    except json.JSONDecodeError as exc:
        return Invalid(f"malformed JSON: {exc.msg} at column {exc.colno}")
    except ValueError as exc:
        if str(exc).startswith("Exceeds the limit"):
            return Invalid("malformed JSON: integer literal too long")
        return Invalid(f"malformed JSON: {exc}")
    except RecursionError:
        return Invalid("malformed JSON: nested too deeply")
    if type(obj) is not dict:
        return Invalid(f"not a JSON object: {_json_kind(obj)}")

    get = obj.get
    payment_id = get("payment_id", _MISSING)
    if payment_id is _MISSING:
        return Invalid("missing field: payment_id")
    merchant_id = get("merchant_id", _MISSING)
    if merchant_id is _MISSING:
        return Invalid("missing field: merchant_id")
    customer_id = get("customer_id", _MISSING)
    if customer_id is _MISSING:
        return Invalid("missing field: customer_id")
    amount = get("amount_cents", _MISSING)
    if amount is _MISSING:
        return Invalid("missing field: amount_cents")
    currency = get("currency", _MISSING)
    if currency is _MISSING:
        return Invalid("missing field: currency")
    created_at = get("created_at", _MISSING)
    if created_at is _MISSING:
        return Invalid("missing field: created_at")

    reason = (
        _check_id("payment_id", payment_id)
        or _check_id("merchant_id", merchant_id)
        or _check_id("customer_id", customer_id)
    )
    if reason is not None:
        return Invalid(reason)
    # `type is int` rejects bool; json gives float for any literal with a fraction or exponent.
    if type(amount) is not int:
        return Invalid("amount_cents: not an integer literal")
    if amount < INT64_MIN or amount > INT64_MAX:
        return Invalid("amount_cents: out of signed 64-bit range")
    if type(currency) is not str:
        return Invalid("currency: not a string")
    if _CURRENCY_RE.fullmatch(currency) is None:
        return Invalid("currency: not three upper-case ASCII letters")
    if type(created_at) is not str:
        return Invalid("created_at: not a string")
    when = _parse_created_at(created_at)
    if type(when) is not datetime:
        return Invalid(when)
    return Payment(payment_id, merchant_id, customer_id, amount, currency, when)


def _json_kind(value: object) -> str:
    """Names the JSON type of a decoded top-level value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return type(value).__name__
