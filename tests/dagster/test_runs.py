"""The step boundary: errors the core marks transient are retried with exponential backoff by
the step's retry policy; every other error fails the step at once, never retried there."""

from __future__ import annotations

import pytest
from dagster import Backoff, DagsterInstance, RetryPolicy, asset, materialize

from assets.runs import TRANSIENT_RETRY_POLICY, at_boundary
from onceflow.errors import ConfigurationError, FencedError, TransientSinkError

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
