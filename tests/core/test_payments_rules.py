"""Every rule of the `payments` input contract, one parametrised case per rule and edge."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from onceflow.jobs._payments_rules import (
    PAYMENT_FIELDS,
    Invalid,
    Payment,
    parse_created_at,
    parse_payment_line,
)

UTC = timezone.utc
DEFAULTS: dict[str, str] = {
    "payment_id": '"p-1"',
    "merchant_id": '"m-1"',
    "customer_id": '"c-1"',
    "amount_cents": "100",
    "currency": '"USD"',
    "created_at": '"2026-03-04T05:06:07Z"',
}
OMIT = object()


def line(**raw_json: object) -> bytes:
    """A line whose fields are the given raw JSON texts over DEFAULTS; OMIT drops a field."""
    fields = {**DEFAULTS, **raw_json}
    body = ",".join(f'"{k}":{v}' for k, v in fields.items() if v is not OMIT)
    return ("{" + body + "}").encode()


def assert_invalid(raw: bytes, reason_prefix: str) -> None:
    result = parse_payment_line(raw)
    assert isinstance(result, Invalid), result
    assert result.reason.startswith(reason_prefix), result.reason


def test_valid_line_parses_all_six_fields() -> None:
    assert parse_payment_line(line()) == Payment(
        "p-1", "m-1", "c-1", 100, "USD", datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    )


# --- blank lines and line framing -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", [b"", b"\n", b"\r\n", b"   ", b"\t \t\n", b" \r\n", b"\x0b\x0c"], ids=repr
)
def test_blank_line_is_ignored(raw: bytes) -> None:
    assert parse_payment_line(raw) is None


@pytest.mark.parametrize(
    "raw",
    [
        line() + b"\n",
        line() + b"\r\n",  # CRLF files
        b"  " + line() + b"\t \r\n",  # white space around the object is fine
        b"{ " + line()[1:-1].replace(b",", b" , ") + b" }",  # white space between tokens
    ],
    ids=["LF", "CRLF", "surrounding-space", "inner-space"],
)
def test_line_framing_accepted(raw: bytes) -> None:
    result = parse_payment_line(raw)
    assert isinstance(result, Payment)
    assert result.payment_id == "p-1"


def test_unicode_only_white_space_is_not_blank() -> None:
    # Only ASCII white space makes a line blank; U+3000 alone is a line that is not JSON.
    assert_invalid("\u3000".encode(), "malformed JSON")


# --- encoding and JSON shape ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (line(customer_id='"c-X"').replace(b"X", b"\xff"), "invalid UTF-8"),
        (b'{"payment_id":"p-\xff\xfe"}', "invalid UTF-8"),
        (b'{"payment_id":"p-\xc3"}', "invalid UTF-8"),  # truncated sequence
        (b'{"payment_id":"p-\xc0\xaf"}', "invalid UTF-8"),  # overlong encoding
        (b'{"payment_id":"p-\xed\xa0\x80"}', "invalid UTF-8"),  # encoded surrogate
        (b"\xef\xbb\xbf" + line(), "UTF-8 byte order mark"),
        (b"  \xef\xbb\xbf" + line(), "UTF-8 byte order mark"),
    ],
    ids=["ff-in-field", "ff-fe", "truncated", "overlong", "surrogate", "bom", "space-bom"],
)
def test_encoding_rules(raw: bytes, reason: str) -> None:
    assert_invalid(raw, reason)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'["p-1","m-1","c-1",100,"USD","2026-03-04T05:06:07Z"]', "not a JSON object: array"),
        (b"42", "not a JSON object: number"),
        (b"-1.5", "not a JSON object: number"),
        (b'"payment"', "not a JSON object: string"),
        (b"null", "not a JSON object: null"),
        (b"true", "not a JSON object: boolean"),
        (line()[:-1], "malformed JSON"),  # truncated
        (line() + b" x", "malformed JSON"),  # trailing garbage
        (line() + line(), "malformed JSON"),  # two objects on one line
        (line() + b",", "malformed JSON"),
        (b"{'payment_id': 'p-1'}", "malformed JSON"),  # single quotes
        (line(amount_cents="100,"), "malformed JSON"),  # trailing comma
        (line(amount_cents="0100"), "malformed JSON"),  # leading zero
        (line(amount_cents="+100"), "malformed JSON"),
        (line(extra="NaN"), "malformed JSON: NaN"),  # even in an ignored field
        (line(amount_cents="Infinity"), "malformed JSON: Infinity"),
        (line(amount_cents="-Infinity"), "malformed JSON: -Infinity"),
        (line(customer_id='"c-\x01"'), "malformed JSON"),  # raw control character in a string
        (line(amount_cents="9" * 5000), "malformed JSON: integer literal too long"),
        (b"[" * 100_000 + b"]" * 100_000, "malformed JSON: nested too deeply"),
        (b"{}", "missing field: payment_id"),
    ],
    ids=[
        "array",
        "number",
        "float",
        "string",
        "null",
        "bool",
        "truncated",
        "trailing-garbage",
        "two-objects",
        "trailing-comma-after-object",
        "single-quotes",
        "trailing-comma-in-object",
        "leading-zero",
        "plus-sign",
        "nan-in-ignored-field",
        "infinity",
        "minus-infinity",
        "raw-control-char",
        "5000-digit-integer",
        "deep-nesting",
        "empty-object",
    ],
)
def test_json_shape_rules(raw: bytes, reason: str) -> None:
    assert_invalid(raw, reason)


def test_other_fields_are_ignored() -> None:
    raw = line(note='{"nested": [1, 2.5, null, true]}', amount_cents_old='"x"')
    assert isinstance(parse_payment_line(raw), Payment)


def test_duplicate_keys_last_value_wins() -> None:
    # Python's json keeps the last value of a repeated key; the contract follows it.
    valid_last = line()[:-1] + b',"amount_cents":7}'
    result = parse_payment_line(line(amount_cents='"bad"')[:-1] + b',"amount_cents":7}')
    assert isinstance(result, Payment)
    assert result.amount_cents == 7
    assert parse_payment_line(valid_last) == result
    assert_invalid(line()[:-1] + b',"amount_cents":"7"}', "amount_cents: not an integer")


def test_non_ascii_and_escaped_strings_are_accepted() -> None:
    raw = line(customer_id='"c-Müller-東京"', merchant_id='"m-\\u00fc\\ud83d\\ude00"')
    result = parse_payment_line(raw)
    assert isinstance(result, Payment)
    assert result.customer_id == "c-Müller-東京"
    assert result.merchant_id == "m-ü😀"


# --- fields -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", PAYMENT_FIELDS)
def test_missing_field(field: str) -> None:
    assert_invalid(line(**{field: OMIT}), f"missing field: {field}")


@pytest.mark.parametrize("field", ["payment_id", "merchant_id", "customer_id"])
@pytest.mark.parametrize(
    ("raw_value", "reason"),
    [
        ('""', "empty"),
        ("null", "not a string"),
        ("1", "not a string"),
        ("true", "not a string"),
        ('["p-1"]', "not a string"),
        ('{"id":"p-1"}', "not a string"),
        ('"\\ud800"', "lone surrogate"),  # escaped lone surrogate: not encodable as UTF-8
        ('"a\\u0000b"', "contains U+0000"),  # PostgreSQL text cannot hold it
    ],
)
def test_id_field_rules(field: str, raw_value: str, reason: str) -> None:
    assert_invalid(line(**{field: raw_value}), f"{field}: {reason}")


@pytest.mark.parametrize("value", [" ", "\t", "0", "p 1", " p-1 "])
def test_id_only_empty_string_is_empty(value: str) -> None:
    # "non-empty" is taken literally: white space counts as content and is kept as given.
    result = parse_payment_line(line(payment_id=f'"{value}"'.replace("\t", "\\t")))
    assert isinstance(result, Payment)
    assert result.payment_id == value


@pytest.mark.parametrize(
    ("raw_value", "expected"),
    [
        ("0", 0),
        ("-0", 0),
        ("-1", -1),
        ("1", 1),
        ("9223372036854775807", 2**63 - 1),  # int64 max
        ("-9223372036854775808", -(2**63)),  # int64 min
        ("9223372036854775806", 2**63 - 2),
        ("-9223372036854775807", -(2**63) + 1),
        ("123456789012345678", 123456789012345678),
    ],
)
def test_amount_valid(raw_value: str, expected: int) -> None:
    result = parse_payment_line(line(amount_cents=raw_value))
    assert isinstance(result, Payment)
    assert result.amount_cents == expected
    assert type(result.amount_cents) is int


@pytest.mark.parametrize(
    ("raw_value", "reason"),
    [
        ("1.0", "not an integer literal"),  # integral but has a fraction
        ("1.5", "not an integer literal"),
        ("1e3", "not an integer literal"),  # integral but has an exponent
        ("1E3", "not an integer literal"),
        ("-0.0", "not an integer literal"),
        ("true", "not an integer literal"),  # bool is an int subclass in Python
        ("false", "not an integer literal"),
        ('"100"', "not an integer literal"),
        ("null", "not an integer literal"),
        ("[100]", "not an integer literal"),
        ('{"v":100}', "not an integer literal"),
        ("9223372036854775808", "out of signed 64-bit range"),  # int64 max + 1
        ("-9223372036854775809", "out of signed 64-bit range"),  # int64 min - 1
        ("18446744073709551616", "out of signed 64-bit range"),
        ("1" + "0" * 40, "out of signed 64-bit range"),
    ],
)
def test_amount_invalid(raw_value: str, reason: str) -> None:
    assert_invalid(line(amount_cents=raw_value), f"amount_cents: {reason}")


@pytest.mark.parametrize("value", ["USD", "EUR", "GBP", "JPY", "AAA", "ZZZ"])
def test_currency_valid(value: str) -> None:
    result = parse_payment_line(line(currency=f'"{value}"'))
    assert isinstance(result, Payment)
    assert result.currency == value


@pytest.mark.parametrize(
    ("raw_value", "reason"),
    [
        ('"usd"', "not three upper-case"),
        ('"Usd"', "not three upper-case"),
        ('"USDX"', "not three upper-case"),
        ('"US"', "not three upper-case"),
        ('""', "not three upper-case"),
        ('"USD\\n"', "not three upper-case"),  # `$` would match before a trailing newline
        ('" USD"', "not three upper-case"),
        ('"US1"', "not three upper-case"),
        ('"ÀBC"', "not three upper-case"),  # upper-case, but not ASCII
        ('"ＵＳＤ"', "not three upper-case"),  # full-width letters
        ("840", "not a string"),
        ("null", "not a string"),
        ('["USD"]', "not a string"),
    ],
)
def test_currency_invalid(raw_value: str, reason: str) -> None:
    assert_invalid(line(currency=raw_value), f"currency: {reason}")


@pytest.mark.parametrize(
    ("value", "expected_utc"),
    [
        ("2026-03-04T05:06:07Z", datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)),
        ("2026-03-04T05:06:07+00:00", datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)),
        ("2026-03-04T05:06:07-00:00", datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)),
        ("2026-03-04T05:06:07.1Z", datetime(2026, 3, 4, 5, 6, 7, 100000, tzinfo=UTC)),
        ("2026-03-04T05:06:07.12Z", datetime(2026, 3, 4, 5, 6, 7, 120000, tzinfo=UTC)),
        ("2026-03-04T05:06:07.000001Z", datetime(2026, 3, 4, 5, 6, 7, 1, tzinfo=UTC)),
        ("2026-03-04T05:06:07.123456Z", datetime(2026, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)),
        (
            "2026-03-04T05:06:07.123456+05:30",
            datetime(2026, 3, 3, 23, 36, 7, 123456, tzinfo=UTC),
        ),
        ("2026-03-04T05:06:07-08:00", datetime(2026, 3, 4, 13, 6, 7, tzinfo=UTC)),
        ("2026-03-04T23:59:59.999999-00:01", datetime(2026, 3, 5, 0, 0, 59, 999999, tzinfo=UTC)),
        ("2026-01-01T01:00:00+05:45", datetime(2025, 12, 31, 19, 15, tzinfo=UTC)),  # year back
        ("2025-12-31T20:00:00-23:59", datetime(2026, 1, 1, 19, 59, tzinfo=UTC)),
        ("2025-12-31T20:00:00+23:59", datetime(2025, 12, 30, 20, 1, tzinfo=UTC)),
        ("2024-02-29T12:00:00Z", datetime(2024, 2, 29, 12, tzinfo=UTC)),  # leap day
        ("2000-02-29T00:00:00Z", datetime(2000, 2, 29, tzinfo=UTC)),
        ("2024-03-01T00:30:00+01:00", datetime(2024, 2, 29, 23, 30, tzinfo=UTC)),
        ("0001-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=UTC)),
        ("9999-12-31T23:59:59.999999Z", datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    ],
)
def test_created_at_valid(value: str, expected_utc: datetime) -> None:
    result = parse_payment_line(line(created_at=f'"{value}"'))
    assert isinstance(result, Payment)
    assert result.created_at == expected_utc
    assert result.created_at.utcoffset() is not None
    assert result.created_at.tzinfo is UTC
    assert parse_created_at(value) == expected_utc


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("2026-03-04t05:06:07Z", "not an RFC 3339"),  # lower-case t
        ("2026-03-04T05:06:07z", "not an RFC 3339"),  # lower-case z
        ("2026-03-04 05:06:07Z", "not an RFC 3339"),  # space separator
        ("2026-03-04T05:06:07", "not an RFC 3339"),  # no offset
        ("2026-03-04T05:06Z", "not an RFC 3339"),  # no seconds
        ("2026-03-04T05:06:07.1234567Z", "not an RFC 3339"),  # 7 fraction digits
        ("2026-03-04T05:06:07.Z", "not an RFC 3339"),  # empty fraction
        ("2026-03-04T05:06:07,5Z", "not an RFC 3339"),  # comma fraction
        ("2026-03-04T05:06:07+0530", "not an RFC 3339"),  # offset without colon
        ("2026-03-04T05:06:07+05", "not an RFC 3339"),
        ("2026-03-04T05:06:07+5:30", "not an RFC 3339"),
        ("2026-03-04T05:06:07Z\n", "not an RFC 3339"),  # trailing newline
        (" 2026-03-04T05:06:07Z", "not an RFC 3339"),
        ("2026-03-04T05:06:07ZZ", "not an RFC 3339"),
        ("2026-3-04T05:06:07Z", "not an RFC 3339"),
        ("20260304T050607Z", "not an RFC 3339"),  # basic ISO 8601 format
        ("2026-03-04", "not an RFC 3339"),
        ("2026-03-04T05:06:07\u0660Z", "not an RFC 3339"),  # Arabic-Indic digit
        ("٢٠٢٦-03-04T05:06:07Z", "not an RFC 3339"),
        ("", "not an RFC 3339"),
        ("2026-02-30T00:00:00Z", "no such date or time"),
        ("2025-02-29T00:00:00Z", "no such date or time"),  # not a leap year
        ("1900-02-29T00:00:00Z", "no such date or time"),
        ("2026-13-01T00:00:00Z", "no such date or time"),
        ("2026-00-01T00:00:00Z", "no such date or time"),
        ("2026-04-31T00:00:00Z", "no such date or time"),
        ("2026-03-04T24:00:00Z", "no such date or time"),
        ("2026-03-04T23:60:00Z", "no such date or time"),
        ("2026-03-04T23:59:60Z", "no such date or time"),  # no leap seconds
        ("0000-01-01T00:00:00Z", "no such date or time"),
        ("2026-03-04T05:06:07+24:00", "offset out of range"),
        ("2026-03-04T05:06:07-05:60", "offset out of range"),
        ("0001-01-01T00:00:00+00:01", "out of range in UTC"),
        ("9999-12-31T23:59:59-00:01", "out of range in UTC"),
    ],
)
def test_created_at_invalid(value: str, reason: str) -> None:
    encoded = value.replace("\n", "\\n")
    assert_invalid(line(created_at=f'"{encoded}"'), f"created_at: {reason}")
    assert parse_created_at(value) is None


@pytest.mark.parametrize("raw_value", ["1772600767", "null", '["2026-03-04T05:06:07Z"]'])
def test_created_at_not_a_string(raw_value: str) -> None:
    assert_invalid(line(created_at=raw_value), "created_at: not a string")


def test_first_broken_field_in_contract_order_is_reported() -> None:
    assert_invalid(line(payment_id='""', currency='"usd"'), "payment_id: empty")
    assert_invalid(line(currency=OMIT, amount_cents="1.5"), "missing field: currency")
