"""The `payments` job without its dedupe (`ONCEFLOW_JOBS=tests.support.payments_no_dedupe:JOB`):
for input without duplicates, a job whose only guard against taking input twice is the
ledger's unit index."""

from __future__ import annotations

import dataclasses

from onceflow.jobs.payments import PAYMENTS

JOB = dataclasses.replace(PAYMENTS, dedupe=None)
