"""The jobs onceflow ships, by name."""

from __future__ import annotations

from onceflow.errors import ConfigurationError
from onceflow.job import Job


def get_job(name: str) -> Job:
    """Return the job named `name`."""
    if name == "payments":
        from onceflow.jobs.payments import PAYMENTS

        return PAYMENTS
    raise ConfigurationError(f"no job named {name!r}; known jobs: payments.")


JOB_NAMES: tuple[str, ...] = ("payments",)

__all__ = ["JOB_NAMES", "get_job"]
