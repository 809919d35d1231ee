"""The resources every job's definitions use, from the environment (as `definitions.py`)."""

from __future__ import annotations

import dagster as dg

from resources import default_resources


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(resources=default_resources())
