"""The `payments` job declared non-deterministic, so every window's outputs are staged before
they are committed: `ONCEFLOW_JOBS=tests.support.staged_payments:STAGED_PAYMENTS`."""

from __future__ import annotations

import dataclasses

from onceflow.jobs.payments import PAYMENTS

STAGED_PAYMENTS = dataclasses.replace(PAYMENTS, deterministic=False)
