"""Resolves postponed annotations on Dagster-decorated functions."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def typed(fn: F) -> F:
    """Resolve `fn`'s string annotations (`from __future__ import annotations`) to types.

    Dagster reads config and resource types from a function's annotations and does not resolve
    strings, so decorated functions in modules with postponed annotations go through this.
    """
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn
