"""`python -m onceflow.cli`, as the `onceflow` console script."""

from __future__ import annotations

import sys

from onceflow.cli._main import main

sys.exit(main())
