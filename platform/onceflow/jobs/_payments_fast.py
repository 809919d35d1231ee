"""The `payments` parse of lines in the common compact shape, vectorised over Arrow.

Most input lines are one compact JSON object with the six contract fields in contract order,
plain ASCII ids and no escapes. For those, a regular expression and a few Arrow kernels give
exactly what `parse_payment_line` gives, without a Python call per line. A line this path is
not sure of, valid or not, is left to `parse_payment_line`: it accepts only what it can prove
valid and computes the same values, so which path took a line never shows in the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

# Printable ASCII but `"` and `\`: a JSON string with no escapes, valid UTF-8, no U+0000.
_ID = r"[\x20\x21\x23-\x5b\x5d-\x7e]+"
# bytes.strip()'s white space.
_WS = r"[ \t\n\r\x0b\x0c]*"
#: The shape, with a named group per part. At most 18 digits always fit a signed 64-bit
#: integer; longer amounts take the slow path.
CANONICAL = (
    rf'^{_WS}\{{"payment_id":"(?P<payment_id>{_ID})","merchant_id":"(?P<merchant_id>{_ID})",'
    rf'"customer_id":"(?P<customer_id>{_ID})","amount_cents":(?P<amount_cents>-?(?:0|[1-9][0-9]{{0,17}})),'
    r'"currency":"(?P<currency>[A-Z]{3})","created_at":"'
    r"(?P<local>[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.(?P<fraction>[0-9]{1,6}))?"
    rf'(?P<offset>Z|[+-][0-9]{{2}}:[0-9]{{2}})"\}}{_WS}$'
)  # fmt: skip
_LOCAL_FORMAT = "%Y-%m-%dT%H:%M:%S"
_US_PER_S = 1_000_000


def parse_canonical(raw: pa.Array) -> tuple[pa.Array, dict[str, pa.Array]]:
    """Parse the lines of `raw` (binary) that match CANONICAL and are surely valid.

    Returns:
        A boolean mask (no nulls) of the lines parsed here, and for those lines, in order, the
        six fields as `parse_payment_line` gives them (`created_at` as UTC microseconds).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = pc.extract_regex(raw, CANONICAL)  # null where a line is not in the shape
    shaped = parts.is_valid()
    parts = parts.filter(shaped)
    field = {group.name: parts.field(group.name) for group in parts.type}
    local_text = pc.cast(field["local"], pa.string())
    local = pc.strptime(local_text, _LOCAL_FORMAT, "s", error_is_null=True)
    # strptime takes some dates that do not exist (Feb 30) and rolls them over: a date is
    # real only if it prints back as it was written (a cast prints "YYYY-MM-DD hh:mm:ss", a
    # space for the "T"; a tenth of strftime's cost). Years 1 and 9999 are left to the slow
    # path, which knows when an offset takes them out of range.
    printed = pc.utf8_replace_slice(local_text, 10, 11, " ")
    year = pc.utf8_slice_codeunits(local_text, 0, 4)
    offset = pc.cast(field["offset"], pa.string())
    zulu = pc.equal(offset, "Z")
    off_h = pc.cast(pc.if_else(zulu, "00", pc.utf8_slice_codeunits(offset, 1, 3)), pa.int64())
    off_m = pc.cast(pc.if_else(zulu, "00", pc.utf8_slice_codeunits(offset, 4, 6)), pa.int64())
    sure = pc.and_(
        pc.and_(
            pc.fill_null(pc.equal(pc.cast(local, pa.string()), printed), False),
            pc.and_(pc.greater(year, "0001"), pc.less(year, "9999")),
        ),
        pc.and_(pc.less_equal(off_h, 23), pc.less_equal(off_m, 59)),
    )
    # Which of `raw`'s lines are parsed here: the shaped ones that are also sure.
    mask = pc.replace_with_mask(shaped, shaped, sure)
    field = {name: pc.filter(values, sure) for name, values in field.items()}
    local = pc.filter(local, sure)
    off_h, off_m = pc.filter(off_h, sure), pc.filter(off_m, sure)
    offset = pc.filter(offset, sure)
    # An absent fraction is an empty match: "" pads to "000000".
    fraction = pc.cast(pc.utf8_rpad(pc.cast(field["fraction"], pa.string()), 6, "0"), pa.int64())
    # UTC = local time − offset ("+05:45" is 5 h 45 min ahead of UTC; "Z" is 0).
    sign = pc.if_else(pc.starts_with(offset, "-"), -1, 1)
    offset_us = pc.multiply(
        pc.multiply(sign, pc.add(pc.multiply(off_h, 3600), pc.multiply(off_m, 60))), _US_PER_S
    )
    utc_us = pc.subtract(
        pc.add(pc.multiply(pc.cast(local, pa.int64()), _US_PER_S), fraction),
        offset_us,
    )
    values = {
        "payment_id": pc.cast(field["payment_id"], pa.string()),
        "merchant_id": pc.cast(field["merchant_id"], pa.string()),
        "customer_id": pc.cast(field["customer_id"], pa.string()),
        "amount_cents": pc.cast(pc.cast(field["amount_cents"], pa.string()), pa.int64()),
        "currency": pc.cast(field["currency"], pa.string()),
        "created_at": pc.cast(utc_us, pa.timestamp("us", tz="UTC")),
    }
    return mask, values
