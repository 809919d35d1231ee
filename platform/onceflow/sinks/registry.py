"""The one place that knows every kind of sink: which group opens a job's specs of each kind.

Outside `sinks/<kind>/`, only this module (and `onceflow/__init__.py`'s public names) names a
kind; everything else works with `SinkSpec` and `SinkGroup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onceflow.errors import ConfigurationError
from onceflow.sinks.base import SinkContext, SinkGroup
from onceflow.sinks.delta.group import DeltaGroup
from onceflow.sinks.delta.spec import DeltaSink
from onceflow.sinks.postgres.group import PostgresGroup
from onceflow.sinks.postgres.spec import PostgresSink
from onceflow.sinks.spec import SinkSpec

Opener = Callable[[Sequence[SinkSpec], SinkContext], list[SinkGroup]]

_OPENERS: dict[type[SinkSpec], Opener] = {
    DeltaSink: DeltaGroup.open_groups,
    PostgresSink: PostgresGroup.open_groups,
}


def register(kind: type[SinkSpec], opener: Opener) -> None:
    """Make `opener` open a job's specs of `kind` (a kind of sink beyond the built-in ones)."""
    _OPENERS[kind] = opener


def open_groups(specs: Sequence[SinkSpec], ctx: SinkContext) -> list[SinkGroup]:
    """Open a job's sinks as the groups that commit together, in the order of their kinds'
    first appearance in the job.

    Raises:
        ConfigurationError: A spec of a kind no group opens.
    """
    kinds: list[type[SinkSpec]] = []
    for spec in specs:
        if type(spec) not in kinds:
            kinds.append(type(spec))
    unknown = [k.__name__ for k in kinds if k not in _OPENERS]
    if unknown:
        raise ConfigurationError(
            f"no sink group opens sinks of kind {unknown[0]}; register one with "
            "onceflow.sinks.registry.register."
        )
    return [group for kind in kinds for group in _OPENERS[kind](specs, ctx)]
