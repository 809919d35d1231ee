"""Window ids as people write them (`3-7`, `1,4,9-10`), Delta interval properties, and the
column that names each row's window."""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from typing import TYPE_CHECKING

from onceflow.errors import ConfigurationError

if TYPE_CHECKING:
    pass

_log = logging.getLogger(__name__)

# Every multi-window frame (reconcile's expected state, the compute path) carries the window
# that produced each row in this column.
WINDOW_COL = "__onceflow_window"
# A window spec names at most this many windows; a larger backfill is several requests.
MAX_WINDOWS_PER_SPEC = 10_000

_UNITS = {
    "nanosecond": timedelta(microseconds=0.001),
    "microsecond": timedelta(microseconds=1),
    "millisecond": timedelta(milliseconds=1),
    "second": timedelta(seconds=1),
    "minute": timedelta(minutes=1),
    "hour": timedelta(hours=1),
    "day": timedelta(days=1),
    "week": timedelta(weeks=1),
}
_INTERVAL_PART = re.compile(r"(\d+)\s*([a-z]+?)s?\b")


def parse_windows(spec: str) -> list[int]:
    """Parse a window spec (`"3-7"`, `"3,5"`, `"1-2, 9"`) into sorted, distinct window ids.

    Raises:
        ConfigurationError: The spec is malformed, names a window below 1, or names too many.
    """
    ids: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ConfigurationError(
                f"windows {spec!r}: {part!r} is not a window id or a range like 3-7"
            ) from None
        if first < 1 or last < first:
            raise ConfigurationError(f"windows {spec!r}: {part!r} must be ids >= 1, low-high")
        if last - first + 1 + len(ids) > MAX_WINDOWS_PER_SPEC:
            raise ConfigurationError(
                f"windows {spec!r}: more than {MAX_WINDOWS_PER_SPEC} windows; split the request"
            )
        ids.update(range(first, last + 1))
    if not ids:
        raise ConfigurationError(f"windows {spec!r}: no window ids given")
    return sorted(ids)


def format_windows(ids: list[int]) -> str:
    """Compact text for window ids: `[1, 2, 3, 5]` → `"1-3,5"`."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = prev = None
    for wid in ordered:
        if start is None or prev is None:
            start = prev = wid
        elif wid == prev + 1:
            prev = wid
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = wid
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)


def parse_interval(text: str) -> timedelta:
    """A Delta interval property (`interval 7 days`, `2 weeks 3 days`) as a timedelta.

    Raises:
        ConfigurationError: When the text is not an interval of known units.
    """
    body = text.strip().lower().removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(body)
    if not parts or _INTERVAL_PART.sub("", body).strip():
        raise ConfigurationError(f"{text!r} is not a Delta interval such as 'interval 7 days'.")
    total = timedelta()
    for number, unit in parts:
        if unit not in _UNITS:
            raise ConfigurationError(f"{text!r}: unknown unit {unit!r}.")
        total += int(number) * _UNITS[unit]
    return total
