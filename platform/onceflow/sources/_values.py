"""Typed sources' column types and the value rules for text.

The value rules for text (a CSV field, or a Parquet string column declared with another type)
are strict, because a value that is silently rounded or guessed lands in a ledger for good:

- surrounding spaces and tabs are trimmed for every type except `string`; a field that is then
  empty is null (a `string` field is kept exactly, and an empty one stays "");
- `int` / `bigint`: an optional sign and ASCII digits, in range (no "1.0", "1e3", "1_000");
- `double`: a decimal literal with an optional exponent; "nan", "inf" and values that overflow
  are invalid;
- `boolean`: "true" or "false", any case;
- `date`: `YYYY-MM-DD`;
- `timestamp`: RFC 3339 with a `Z` or `±HH:MM` offset (`T`, `t` or a space between date and
  time), converted to UTC; naive timestamps, leap seconds and digits past microseconds (other
  than zeros) are invalid;
- `decimal(p,s)`: a decimal literal (exponent allowed) that fits exactly: more than `s` digits
  after the point (trailing zeros aside) or more than `p - s` before it is invalid, never
  rounded;
- every value: dates and timestamps must fall in the years 1–9999, and strings must not hold
  U+0000 (PostgreSQL text cannot store it, so a sink would refuse the row forever);
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from decimal import Context, Decimal, InvalidOperation
from typing import Any

import pyarrow as pa

from onceflow.errors import ConfigurationError

_SIMPLE_TYPES = ("string", "bigint", "int", "double", "boolean", "date", "timestamp")
_DECIMAL_TYPE = re.compile(r"decimal\(\s*([0-9]+)\s*,\s*([0-9]+)\s*\)\Z", re.ASCII)
_MAX_DECIMAL_PRECISION = 38


@dataclass(frozen=True)
class ColumnType:
    """One declared column type.

    Attributes:
        kind: `string`, `bigint`, `int`, `double`, `boolean`, `date`, `timestamp` or `decimal`.
        precision: Total digits of a decimal (0 otherwise).
        scale: Digits after the point of a decimal (0 otherwise).
    """

    kind: str
    precision: int = 0
    scale: int = 0

    @property
    def sql(self) -> str:
        """The Spark SQL spelling (`decimal(12,2)`, `bigint`)."""
        if self.kind == "decimal":
            return f"decimal({self.precision},{self.scale})"
        return self.kind

    def arrow(self) -> pa.DataType:
        """The Arrow type Spark expects for this column in a data source's batches."""
        if self.kind == "decimal":
            return pa.decimal128(self.precision, self.scale)
        return _ARROW_TYPES[self.kind]()


_ARROW_TYPES: dict[str, Callable[[], pa.DataType]] = {
    "string": pa.string,
    "bigint": pa.int64,
    "int": pa.int32,
    "double": pa.float64,
    "boolean": pa.bool_,
    "date": pa.date32,
    "timestamp": lambda: pa.timestamp("us", tz="UTC"),
}


def parse_type(text: str, column: str) -> ColumnType:
    """Read a declared type (case and spaces inside `decimal(…)` do not matter).

    Args:
        text: The type as written in the schema.
        column: The column it belongs to, for the error message.

    Raises:
        ConfigurationError: The type is not one typed sources support.
    """
    allowed = ", ".join((*_SIMPLE_TYPES, "decimal(p,s)"))
    if not isinstance(text, str):
        raise ConfigurationError(
            f"column {column!r}: type must be a string such as 'bigint', not "
            f"{type(text).__name__}; use one of {allowed}."
        )
    norm = text.strip().lower()
    if norm in _SIMPLE_TYPES:
        return ColumnType(norm)
    match = _DECIMAL_TYPE.match(norm)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        if not 1 <= precision <= _MAX_DECIMAL_PRECISION or scale > precision:
            raise ConfigurationError(
                f"column {column!r}: {text!r} is out of bounds; use decimal(p,s) with "
                f"1 ≤ p ≤ {_MAX_DECIMAL_PRECISION} and 0 ≤ s ≤ p."
            )
        return ColumnType("decimal", precision, scale)
    raise ConfigurationError(f"column {column!r}: unknown type {text!r}; use one of {allowed}.")


class Invalid(ValueError):
    """A value breaks its column's rule; the message says how (never quoting the value)."""


TextConverter = Callable[[str], Any]

_INT = re.compile(r"[+-]?[0-9]+\Z", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z", re.ASCII)
_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})\Z", re.ASCII)
_TIMESTAMP = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))?\Z",
    re.ASCII,
)
_TRIM = " \t"
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_DAY_US = 86_400_000_000
#: Timestamps (µs since the epoch, UTC) that stay inside the years 1–9999.
MIN_TIMESTAMP_US = (date(1, 1, 1).toordinal() - _EPOCH_ORDINAL) * _DAY_US
MAX_TIMESTAMP_US = (date(9999, 12, 31).toordinal() - _EPOCH_ORDINAL + 1) * _DAY_US - 1
_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "bigint": (-(2**63), 2**63 - 1)}


def _string(text: str) -> str:
    if "\x00" in text:
        raise Invalid("contains U+0000, which PostgreSQL text cannot store")
    return text


def _integer(kind: str) -> TextConverter:
    low, high = _INT_RANGES[kind]

    def convert(text: str) -> int | None:
        text = text.strip(_TRIM)
        if not text:
            return None
        if not _INT.match(text):
            raise Invalid("not an integer")
        # int() refuses very long digit strings (and they are out of range anyway).
        if len(text.lstrip("+-").lstrip("0")) > 20:
            raise Invalid(f"out of range for {kind}")
        value = int(text)
        if not low <= value <= high:
            raise Invalid(f"out of range for {kind}")
        return value

    return convert


def _double(text: str) -> float | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    if not _FLOAT.match(text):
        raise Invalid("not a number (nan and inf are not accepted)")
    value = float(text)
    if math.isinf(value):
        raise Invalid("out of range for double")
    return value


def _boolean(text: str) -> bool | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    folded = text.lower()
    if folded == "true":
        return True
    if folded == "false":
        return False
    raise Invalid("not a boolean (true or false)")


def _date(text: str) -> date | None:
    text = text.strip(_TRIM)
    if not text:
        return None
    match = _DATE.match(text)
    if not match:
        raise Invalid("not a date (YYYY-MM-DD)")
    try:
        return date(int(match.group(1)), int(match.group(2)), int(match.group(3)))
    except ValueError:
        raise Invalid("not a valid calendar date") from None


def _timestamp(text: str) -> int | None:
    """Micro-seconds since the epoch, UTC."""
    text = text.strip(_TRIM)
    if not text:
        return None
    match = _TIMESTAMP.match(text)
    if not match:
        raise Invalid("not an RFC 3339 timestamp (YYYY-MM-DDTHH:MM:SS[.ffffff]Z or ±HH:MM)")
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if zulu is None and sign is None:
        raise Invalid("timestamp has no UTC offset (add Z or ±HH:MM)")
    try:
        days = date(int(year), int(month), int(day)).toordinal() - _EPOCH_ORDINAL
    except ValueError:
        raise Invalid("not a valid calendar date") from None
    if int(hour) > 23 or int(minute) > 59 or int(second) > 59:
        raise Invalid("not a valid time of day")
    micros = 0
    if fraction:
        if len(fraction) > 6 and fraction[6:].strip("0"):
            raise Invalid("more precise than microseconds")
        micros = int(fraction[:6].ljust(6, "0"))
    offset_s = 0
    if sign is not None:
        if int(off_h) > 23 or int(off_m) > 59:
            raise Invalid("not a valid UTC offset")
        offset_s = (int(off_h) * 3600 + int(off_m) * 60) * (1 if sign == "+" else -1)
    seconds = days * 86400 + int(hour) * 3600 + int(minute) * 60 + int(second) - offset_s
    value = seconds * 1_000_000 + micros
    if not MIN_TIMESTAMP_US <= value <= MAX_TIMESTAMP_US:
        raise Invalid("outside the years 1-9999 in UTC")
    return value


def _decimal(precision: int, scale: int) -> TextConverter:
    quantum = Decimal(1).scaleb(-scale)
    context = Context(prec=precision)
    integer_digits = precision - scale

    def convert(text: str) -> Decimal | None:
        text = text.strip(_TRIM)
        if not text:
            return None
        if not _FLOAT.match(text):
            raise Invalid("not a decimal number")
        try:
            value = Decimal(text)
        except (InvalidOperation, ValueError):
            raise Invalid("not a decimal number") from None
        if value.is_zero():
            return Decimal(0).quantize(quantum, context=context)
        _, digits, exponent = value.as_tuple()
        assert isinstance(exponent, int)
        count = len(digits)
        # Zeros at the end of the fraction carry no value: "1.50" fits decimal(p,1).
        while exponent < 0 and digits[count - 1] == 0:
            count -= 1
            exponent += 1
        if -exponent > scale:
            raise Invalid(
                f"more than {scale} digits after the point for decimal({precision},{scale})"
            )
        if count + exponent > integer_digits:
            raise Invalid(f"too large for decimal({precision},{scale})")
        return value.quantize(quantum, context=context)

    return convert


def text_converter(ctype: ColumnType) -> TextConverter:
    """The function that turns a text field into a `ctype` value, or raises `Invalid`.

    Timestamps come back as micro-seconds since the epoch (UTC), the rest as Python values
    Arrow takes for `ctype.arrow()`.
    """
    if ctype.kind == "string":
        return _string
    if ctype.kind in _INT_RANGES:
        return _integer(ctype.kind)
    if ctype.kind == "decimal":
        return _decimal(ctype.precision, ctype.scale)
    return {"double": _double, "boolean": _boolean, "date": _date, "timestamp": _timestamp}[
        ctype.kind
    ]
