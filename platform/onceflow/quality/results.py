"""What a validation reports: one result per check, by sink and name."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check on one sink.

    Attributes:
        sink: The sink's name (`pg_payments`, `lake_payments`, …).
        check: The check's name: `keys_unique`, `row_count`, `not_null:<column>`,
            `regex:<column>` or `sum_consistency`.
        passed: Whether the sink satisfied it.
        observed: What was measured (counts, never row values), with `expected` where the check
            compares with an expected number and `error` when the check could not run.
        description: What the check proves.
    """

    sink: str
    check: str
    passed: bool
    observed: dict[str, int | float | str]
    description: str


@dataclass(frozen=True)
class ValidationReport:
    """Every check run for a job.

    Attributes:
        job: The job's name.
        results: One result per check, grouped by target in the order the targets were given.
        data_docs: The path of the Data Docs index page, when Data Docs were built.
        timings: Wall-clock seconds per suite (keyed by suite name, `<job>.<sink>[.<suffix>]`),
            and for Delta targets the Spark read and aggregation alone (`<suite>:spark`).
        through_window: The newest window completed when the checks started: the results speak
            for every window up to it (0: none).
    """

    job: str
    results: list[CheckResult]
    data_docs: str | None
    timings: dict[str, float] = field(default_factory=dict)
    through_window: int = 0

    @property
    def passed(self) -> bool:
        """True when every check passed."""
        return all(result.passed for result in self.results)

    def failures(self) -> list[CheckResult]:
        """Return the checks that failed.

        Returns:
            The failed results, in report order.
        """
        return [result for result in self.results if not result.passed]
