"""The `payments` job with one more sink: `pg_payment_log`, a keyless append table holding
each payment's id, amount and window once (`ONCEFLOW_JOBS=tests.support.payment_log:JOB`)."""

from __future__ import annotations

import dataclasses

from onceflow.jobs.payments import PAYMENTS
from onceflow.sinks.postgres.spec import PostgresSink

PAYMENT_LOG = PostgresSink(
    name="pg_payment_log",
    output="payments",
    table="payment_log",
    columns={"payment_id": "text", "amount_cents": "bigint", "_window_id": "bigint"},
    key=(),
    mode="append",
    window_column="_window_id",
)
JOB = dataclasses.replace(PAYMENTS, sinks=(*PAYMENTS.sinks, PAYMENT_LOG))
