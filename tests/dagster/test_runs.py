"""The step boundary: errors the core marks transient are retried with exponential backoff by
the step's retry policy; every other error fails the step at once, never retried there; a
terminal one (`onceflow.errors.is_terminal`) is neither retried as a run nor recovered."""

from __future__ import annotations

import pytest
from dagster import (
    Backoff,
    DagsterInstance,
    DagsterRun,
    RetryPolicy,
    asset,
    build_sensor_context,
    materialize,
)

import definitions
from assets.runs import TRANSIENT_RETRY_POLICY, at_boundary
from onceflow.errors import (
    ConfigurationError,
    FencedError,
    SinkStateError,
    TransientSinkError,
)

# The real policy's shape with a delay short enough for a test.
FAST = RetryPolicy(
    max_retries=TRANSIENT_RETRY_POLICY.max_retries,
    delay=0.01,
    backoff=TRANSIENT_RETRY_POLICY.backoff,
    jitter=None,
)


def test_the_policy_backs_off_exponentially() -> None:
    policy = RetryPolicy(  # without the jitter, to compare delays
        max_retries=TRANSIENT_RETRY_POLICY.max_retries,
        delay=TRANSIENT_RETRY_POLICY.delay,
        backoff=TRANSIENT_RETRY_POLICY.backoff,
    )
    assert TRANSIENT_RETRY_POLICY.backoff is Backoff.EXPONENTIAL
    delays = [policy.calculate_delay(n) for n in (1, 2, 3)]
    assert delays[0] > 0 and delays[1] > 2 * delays[0] and delays[2] > 2 * delays[1]


@pytest.mark.parametrize(
    ("error", "attempts"),
    [
        # Transient (retryable): the step is tried 1 + max_retries times.
        (TransientSinkError("connection lost during COPY"), 1 + FAST.max_retries),
        # Not retryable: a fenced zombie, a wrong setting, and an error the core does not know.
        (FencedError("a newer run owns the job"), 1),
        (ConfigurationError("window 9 was never planned"), 1),
        (ZeroDivisionError("division by zero"), 1),
    ],
)
def test_only_transient_errors_are_retried(error: Exception, attempts: int) -> None:
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        raise error

    @asset(retry_policy=FAST)
    def step() -> None:
        at_boundary(work)()

    with DagsterInstance.ephemeral() as instance:
        result = materialize([step], instance=instance, raise_on_error=False)
    assert not result.success
    assert len(calls) == attempts


def test_a_transient_error_that_clears_succeeds_on_retry() -> None:
    calls: list[int] = []

    def work() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise TransientSinkError("serialization conflict")
        return len(calls)

    @asset(retry_policy=FAST)
    def step() -> int:
        return at_boundary(work)()

    with DagsterInstance.ephemeral() as instance:
        result = materialize([step], instance=instance)
    assert result.success and len(calls) == 3


def test_failures_redact_credentials() -> None:
    from dagster import Failure

    def work() -> None:
        raise ConfigurationError("cannot reach postgresql://alice:s3cret@db/x")

    with pytest.raises(Failure) as raised:
        at_boundary(work)()
    assert "s3cret" not in raised.value.description
    assert raised.value.allow_retries is False


ERRORS = [
    # (error, retried, recovered): an onceflow error marked neither retryable nor recoverable
    # is terminal (neither); a sink that lacks windows is repaired by recovery, not a retry.
    (ConfigurationError("windows '99': window 99 was never planned"), False, False),
    (FencedError("a newer run owns the job"), False, False),
    (SinkStateError("sink lake_payments lacks window 3; run onceflow reconcile"), False, True),
    (TransientSinkError("connection lost during COPY"), True, True),
    (ZeroDivisionError("division by zero"), True, True),
]


def _failed_run(instance: DagsterInstance, error: Exception) -> DagsterRun:
    def work() -> None:
        raise error

    @asset
    def step(context) -> None:  # unannotated: Dagster reads the annotation, a string here
        at_boundary(work, context)()

    result = materialize(
        [step], instance=instance, raise_on_error=False, tags={"onceflow/job": "payments"}
    )
    assert not result.success
    return instance.get_run_by_id(result.run_id)


@pytest.mark.parametrize(
    ("error", "retried", "recovered"), ERRORS, ids=[type(e).__name__ for e, _, _ in ERRORS]
)
def test_dagster_retries_a_failed_run_unless_its_error_is_terminal(
    error: Exception, retried: bool, recovered: bool
) -> None:
    settings = {"run_retries": {"enabled": True, "max_retries": 2}}
    with DagsterInstance.ephemeral(settings=settings) as instance:
        run = _failed_run(instance, error)
    assert run.tags["dagster/will_retry"] == ("true" if retried else "false")
    assert (run.tags.get("onceflow/terminal_failure") == run.run_id) is not recovered


def test_the_failure_sensor_recovers_only_runs_that_failed_for_a_passing_reason() -> None:
    sensor = definitions.defs.get_sensor_def("payments_failure_sensor")
    with DagsterInstance.ephemeral() as instance:
        runs = [(_failed_run(instance, e), recovered) for e, _, recovered in ERRORS]
        tick = sensor(build_sensor_context(instance=instance, cursor=None))
    started = {r.run_key for r in tick.run_requests}
    assert started == {run.run_id for run, recovered in runs if recovered}
