"""Module sizes: no module of the core is so long that a newcomer cannot read it whole."""

from __future__ import annotations

from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "platform" / "onceflow"
MAX_LINES = 600

# Modules still being split on other branches of the same issue; each leaves this list when its
# split is merged, and the list is empty once they all are.
BEING_SPLIT = frozenset(
    {
        "sinks/postgres/commit.py",  # the sink contract's split (sinks/)
        "sinks/postgres/group.py",  # the sink contract's split (sinks/)
        "_keyindex.py",  # the shared COPY helper's split (_keyindex)
    }
)


def _lines() -> dict[str, int]:
    return {
        str(path.relative_to(CORE)): len(path.read_text().splitlines())
        for path in sorted(CORE.rglob("*.py"))
    }


def test_no_module_of_the_core_is_over_600_lines() -> None:
    """Every module in platform/onceflow holds at most 600 lines, but those being split."""
    sizes = _lines()
    assert len(sizes) > 50  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES and name not in BEING_SPLIT}
    assert over == {}, f"split these modules by concern (at most {MAX_LINES} lines each): {over}"


def test_the_modules_being_split_still_exist() -> None:
    """An allow-list entry whose module is gone or already small is dropped from the list."""
    sizes = _lines()
    stale = sorted(name for name in BEING_SPLIT if sizes.get(name, 0) <= MAX_LINES)
    assert stale == [], f"remove these from BEING_SPLIT in tests/core/test_sizes.py: {stale}"
