"""`DeltaSink`: a job's output appended to a Delta table, one Delta commit per window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from onceflow.errors import ConfigurationError
from onceflow.sinks.base import SinkSpec


@dataclass(frozen=True)
class DeltaSink(SinkSpec):
    """A Delta table at `<lake>/<table>`, appended once per window.

    Attributes:
        name: The sink's name.
        output: The transform output it receives.
        table: The table's folder under the lake root.
    """

    table: str

    kind: ClassVar[str] = "delta"
    holds_dedupe_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        parts = self.table.split("/")
        if not self.table or any(p in ("", ".", "..") for p in parts):
            raise ConfigurationError(
                f"sink {self.name}: table {self.table!r} must be a relative folder under the "
                "lake, such as 'payments' or 'finance/payments'."
            )

    def describe(self) -> str:
        return f"Delta table `{self.table}`"

    @property
    def lake_table(self) -> str | None:
        return self.table
