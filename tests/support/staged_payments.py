"""The `payments` job declared non-deterministic, so every window's outputs are staged before
they are committed: `ONCEFLOW_JOBS=tests.support.staged_payments:STAGED_PAYMENTS`.

`STAGED_PAYMENTS_PG_FIRST` is the same job with its PostgreSQL sinks listed first, so a window
is committed to PostgreSQL before Delta (sink groups commit in the order of their kinds' first
sink): a window whose PostgreSQL commit is held up is held by no sink yet."""

from __future__ import annotations

import dataclasses

from onceflow.jobs.payments import PAYMENTS
from onceflow.sinks.postgres.spec import PostgresSink

STAGED_PAYMENTS = dataclasses.replace(PAYMENTS, deterministic=False)
STAGED_PAYMENTS_PG_FIRST = dataclasses.replace(
    STAGED_PAYMENTS,
    sinks=(
        *(s for s in PAYMENTS.sinks if isinstance(s, PostgresSink)),
        *(s for s in PAYMENTS.sinks if not isinstance(s, PostgresSink)),
    ),
)
