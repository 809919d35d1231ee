"""Fault matrices: every point runs with `make test-all`; CI (`make test`) runs the
representative ones, the rest carry the `exhaustive` mark."""

from __future__ import annotations

import pytest


def points(*names: str, in_ci: tuple[str, ...]) -> list:
    """`names` as pytest params, all but `in_ci` marked `exhaustive`."""
    unknown = set(in_ci) - set(names)
    assert not unknown, f"in_ci names points the matrix lacks: {sorted(unknown)}"
    return [
        pytest.param(p) if p in in_ci else pytest.param(p, marks=pytest.mark.exhaustive)
        for p in names
    ]
