"""Run configuration of a job's runs and recovery runs, as the launchpad shows it."""

from __future__ import annotations

from typing import Literal

from dagster import Config
from pydantic import Field

# A window spec names at most this many windows; a larger backfill is several runs.
MAX_WINDOWS_PER_SPEC = 10_000


class WindowRunConfig(Config):
    """What a run of a job does. Empty: process new data.

    Attributes:
        max_files_per_window: Most files a new window takes (the engine's default when empty).
        windows: Past windows to backfill, e.g. `"3-7"` or `"3,5,9-10"`. A window every sink
            already holds is left alone and reported as a no-op.
        restate: With `windows`, replace exactly those windows' effect in every sink.
    """

    max_files_per_window: int | None = Field(default=None, ge=1)
    windows: str = ""
    restate: bool = False


class RecoveryConfig(Config):
    """What a recovery run does after replaying pending windows.

    Attributes:
        reconcile: `incremental` (windows since the last verified one), `full` (every window),
            or `off` (replay and verify commit markers only).
        dry_run: Report the differences reconcile finds without repairing them.
        verify_last: Check the commit state of the last this-many windows (0: every window).
    """

    reconcile: Literal["incremental", "full", "off"] = "incremental"
    dry_run: bool = False
    verify_last: int = Field(default=1000, ge=0)


def parse_windows(spec: str) -> list[int]:
    """Parse a window spec (`"3-7"`, `"3,5"`, `"1-2, 9"`) into sorted, distinct window ids.

    Raises:
        ValueError: The spec is malformed, names a window below 1, or names too many windows.
    """
    ids: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(
                f"windows {spec!r}: {part!r} is not a window id or a range like 3-7"
            ) from None
        if first < 1 or last < first:
            raise ValueError(f"windows {spec!r}: {part!r} must be ids >= 1, low-high")
        if last - first + 1 + len(ids) > MAX_WINDOWS_PER_SPEC:
            raise ValueError(
                f"windows {spec!r}: more than {MAX_WINDOWS_PER_SPEC} windows; split the backfill"
            )
        ids.update(range(first, last + 1))
    if not ids:
        raise ValueError(f"windows {spec!r}: no window ids given")
    return sorted(ids)


def format_windows(ids: list[int]) -> str:
    """Compact text for window ids: `[1, 2, 3, 5]` → `"1-3,5"`."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    start = prev = None
    for wid in ordered:
        if start is None:
            start = prev = wid
        elif wid == prev + 1:  # type: ignore[operator]
            prev = wid
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = wid
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)
