"""The definitions of `components/defs/`: one `OnceflowJobComponent` per job and the resources.
`dg` loads this module (`[tool.dg.project]` in pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
