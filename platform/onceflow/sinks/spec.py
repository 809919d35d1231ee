"""A sink spec: one output of a job and where it goes (job data; each kind subclasses it).

Knows nothing of the groups that commit it: `onceflow.sinks.registry` opens each kind's specs
as its groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from onceflow._identifiers import check_identifier


@dataclass(frozen=True)
class SinkSpec(ABC):
    """One output of a job and where it goes. Subclasses are the sink kinds.

    Attributes:
        name: The sink's name: an identifier, unique among every job's sinks (it is the asset
            key in Dagster and keys the sink's commit records).
        output: The name of the transform output this sink receives.
    """

    name: str
    output: str

    #: The kind's name (`delta`, `postgres`), shown in status and the UI.
    kind: ClassVar[str] = "sink"
    #: Whether `SinkGroup.seen_keys` works for this kind (first-occurrence dedupe state).
    holds_dedupe_state: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_identifier(self.name, "sink name")
        check_identifier(self.output, f"sink {self.name}: output")

    @abstractmethod
    def describe(self) -> str:
        """One line saying where the sink writes (no credentials)."""

    @property
    def lake_table(self) -> str | None:
        """The table under the lake root this sink writes, if any (for lineage between jobs)."""
        return None

    @property
    def table_name(self) -> str | None:
        """The table's name as a data catalog shows it (no credentials): by default the table
        under the lake root, if any."""
        return self.lake_table

    def declared_columns(self) -> tuple[tuple[str, str], ...]:
        """(name, type) of the columns the job declares for this sink (empty when its columns
        follow the transform's output and are known only once written)."""
        return ()

    @property
    def untyped_columns(self) -> list[str]:
        """Columns declared without a type, to take the type of the source's column."""
        return []

    def typed(self, types: Mapping[str, str]) -> SinkSpec:
        """This sink with its untyped columns typed from `types` (the source's columns)."""
        return self

    @property
    def is_quarantine_table(self) -> bool:
        """Whether the sink writes the shared quarantine table (`quarantine_table()`)."""
        return False
