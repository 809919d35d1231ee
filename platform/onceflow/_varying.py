"""Expressions whose value is not a function of the rows: they vary from one computation of a
window to the next.

A job declared `deterministic=True` is computed again from its input on a replay, and every
sink and every retry must get the rows the first computation gave. `rand()`, `uuid()`,
`monotonically_increasing_id()`, a UDF marked non-deterministic (Spark counts these
non-deterministic) or the clock (`current_timestamp()`, `current_date()`: Spark counts them
deterministic within one query) would give a replay other rows than the sinks already hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceflow._plan_reruns import plan_nodes

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# The clock's expressions, by node name, and how a plan's text shows them.
_CLOCK = {
    "CurrentTimestamp": "current_timestamp(",
    "Now": "now(",
    "CurrentDate": "current_date(",
    "LocalTimestamp": "localtimestamp(",
    "CurrentTime": "current_time(",
}


def varying(df: DataFrame) -> list[str]:
    """The expressions of `df`'s plan whose value varies from one computation to the next,
    by their SQL name (empty: none)."""
    plan = df._jdf.queryExecution().analyzed()
    # Two calls for a plan that has none (every window of a deterministic job asks).
    if plan.deterministic() and not any(text in plan.toString() for text in _CLOCK.values()):
        return []
    found: list[str] = []
    for node in plan_nodes(plan):
        expressions = node.expressions()
        found.extend(_varying_in([expressions.apply(i) for i in range(expressions.size())]))
    return sorted(set(found))


def _varying_in(expressions: list[Any]) -> list[str]:
    """The innermost non-deterministic or clock expressions among `expressions`' trees."""
    found: list[str] = []
    stack = list(expressions)
    while stack:
        expr = stack.pop()
        children = expr.children()
        kids = [children.apply(i) for i in range(children.size())]
        if expr.nodeName() in _CLOCK:
            found.append(f"{expr.prettyName()}()")
        elif not expr.deterministic() and all(k.deterministic() for k in kids):
            found.append(f"{expr.prettyName()}()")
        stack.extend(kids)
    return found
