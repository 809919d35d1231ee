"""Module sizes: no module of the core is so long that a newcomer cannot read it whole."""

from __future__ import annotations

from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "platform" / "onceflow"
MAX_LINES = 600


def _lines() -> dict[str, int]:
    return {
        str(path.relative_to(CORE)): len(path.read_text().splitlines())
        for path in sorted(CORE.rglob("*.py"))
    }


def test_no_module_of_the_core_is_over_600_lines() -> None:
    """Every module in platform/onceflow holds at most 600 lines."""
    sizes = _lines()
    assert len(sizes) > 50  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"split these modules by concern (at most {MAX_LINES} lines each): {over}"
