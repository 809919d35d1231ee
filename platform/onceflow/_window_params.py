"""A window's parameters, read by its Spark tasks when they run, not built into its plan.

Planning a window's outputs (the source read, the parse, the transform, the quarantine and key
outputs) costs the driver a few hundred round trips to the JVM and an analysis per DataFrame
operation, every window. A run plans them once per slot instead (`_compute.Template`): the
plan's steps take what differs from window to window (the files to read, the window's id, the
key lookup's bounds) from the window's parameters, which travel as a Spark local property of
the thread that runs the window's jobs; every task of those jobs sees it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PROPERTY = "onceflow.window"


def supported(spark: SparkSession) -> bool:
    """Whether the session's jobs can carry local properties (a Spark Connect session plans
    on the client, cheaply, and has none)."""
    return not type(spark).__module__.startswith("pyspark.sql.connect")


@contextmanager
def bound(spark: SparkSession, params: Mapping[str, Any] | None) -> Iterator[None]:
    """Give the Spark jobs this thread starts inside the block the window's `params` (none to
    give: nothing is set)."""
    if params is None:
        yield
        return
    context = spark.sparkContext
    context.setLocalProperty(PROPERTY, json.dumps(params))
    try:
        yield
    finally:
        context.setLocalProperty(PROPERTY, None)  # type: ignore[arg-type]  # None removes it


def _task_params() -> dict[str, Any] | None:
    """The parameters given to the task that runs this; None outside such a task."""
    from pyspark import TaskContext

    context = TaskContext.get()
    value = context.getLocalProperty(PROPERTY) if context is not None else None
    return None if value is None else dict(json.loads(value))


def current() -> dict[str, Any]:
    """The parameters of the window whose task runs this (on an executor's Python worker)."""
    params = _task_params()
    if params is None:
        raise RuntimeError(
            "a step planned for any window ran in a Spark job started outside `bound`: it has "
            "no window to read."
        )
    return params


def task_window_id() -> int | None:
    """The id of the window whose task runs this; None outside a task given a window."""
    params = _task_params()
    return None if params is None else int(params["window_id"])
