"""Whether a Spark plan, run again, computes everything again; whether planning ran jobs.

A run keeps a slot's plan from window to window (`_compute.Computed.cache_kept`,
`sinks.writers.WritersPlan`): each window's rows come from its parameters, and Spark executes
the same physical plan again. Most of a physical plan recomputes from its input on every
execution, but some of it runs once per plan and is taken again afterwards: a shuffle's map
outputs (the plan's exchange keeps its shuffle, and Spark skips map stages whose outputs
exist), a broadcast's relation, a subquery's result, adaptive execution's finished query
stages. Run again for a later window, such a plan would give an earlier window's rows: a plan
that holds any of them is planned again for each window. Nor does a plan hold for any window
whose making ran Spark jobs of its own (a transform that counts or collects its rows while
planning): what they found went into the plan as it was for the first window.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Physical operators whose results outlive one execution of their plan (by `nodeName`).
_KEPT_ONCE = ("Exchange", "Subquery", "QueryStage", "AdaptiveSparkPlan")


def plan_nodes(plan: Any) -> Iterator[Any]:
    """Every node of a JVM query plan: its children's, its cached relations' plans and its
    subqueries' (a tree: a relation read twice is walked twice)."""
    stack = [plan]
    while stack:
        node = stack.pop()
        yield node
        for related in ("children", "innerChildren", "subqueries"):
            items = getattr(node, related)()
            stack.extend(items.apply(i) for i in range(items.size()))


def kept_once(df: DataFrame) -> list[str]:
    """The operators of `df`'s physical plan (its cached relations' plans and its subqueries
    included) whose results a second execution of the plan would take again, by name."""
    names = (node.nodeName() for node in plan_nodes(df._jdf.queryExecution().executedPlan()))
    return [name for name in names if any(part in name for part in _KEPT_ONCE)]


def reruns_afresh(df: DataFrame) -> bool:
    """Whether executing `df`'s physical plan again computes every row from its input again
    (see the module)."""
    return not kept_once(df)


# The local properties that make a job group (`SparkContext.setJobGroup`).
_GROUP_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


@contextmanager
def jobs_started(spark: SparkSession) -> Iterator[Callable[[], int]]:
    """Counts the Spark jobs this thread starts inside the block (the callable, asked after
    it); the thread's own job group, if any, is given back after."""
    context = spark.sparkContext
    before = {name: context.getLocalProperty(name) for name in _GROUP_PROPERTIES}
    group = f"onceflow-planning-{uuid.uuid4().hex}"
    context.setJobGroup(group, "planning a window's outputs")
    try:
        yield lambda: len(context.statusTracker().getJobIdsForGroup(group))
    finally:
        for name, value in before.items():
            context.setLocalProperty(name, value)  # type: ignore[arg-type]  # None removes it
