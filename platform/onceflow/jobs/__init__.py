"""The reference jobs onceflow ships: `payments` and `daily_totals` (see docs/jobs.md).

They are ordinary job modules, found like any user's (`onceflow.registry`).
"""

from __future__ import annotations
