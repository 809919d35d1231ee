"""The `payments` job with a changed transform (every amount one cent), for restatement tests
that run the real CLI: `ONCEFLOW_JOBS=tests.support.flat_fee_payments:FLAT_FEE`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow.job import WindowContext
from onceflow.jobs.payments import PAYMENTS, transform_payments


def flat_fee(valid: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    return transform_payments(valid.withColumn("amount_cents", F.lit(1).cast("bigint")), ctx)


FLAT_FEE = dataclasses.replace(PAYMENTS, transform=flat_fee)
