"""Settings from the environment (`ONCEFLOW_*`), checked when they are loaded."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from onceflow.errors import ConfigurationError


@dataclass(frozen=True)
class Settings:
    """Where onceflow keeps its state and finds its input.

    Attributes:
        home: Folder for embedded state (`ONCEFLOW_HOME`, default `.onceflow`).
        postgres_dsn: DSN of the PostgreSQL holding the sinks and the ledger; `None` means an
            embedded server under `home/postgres`. Never printed.
        lake: Root folder of the Delta tables (`ONCEFLOW_LAKE`, default `home/lake`).
        landing: Root folder of the landing files (`ONCEFLOW_LANDING`, default `home/landing`).
    """

    home: Path
    postgres_dsn: str | None
    lake: Path
    landing: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from `env` (default `os.environ`)."""
        env = os.environ if env is None else env
        home = Path(env.get("ONCEFLOW_HOME") or ".onceflow").absolute()
        dsn = env.get("ONCEFLOW_POSTGRES_DSN") or None
        lake = Path(env.get("ONCEFLOW_LAKE") or home / "lake").absolute()
        landing = Path(env.get("ONCEFLOW_LANDING") or home / "landing").absolute()
        return cls(home=home, postgres_dsn=dsn, lake=lake, landing=landing)

    def __repr__(self) -> str:
        dsn = "<set>" if self.postgres_dsn else "<embedded>"
        return f"Settings(home={self.home}, postgres_dsn={dsn}, lake={self.lake}, landing={self.landing})"

    def check_folders(self, *, create: bool = True) -> None:
        """Make sure the lake is writable and the landing folder exists."""
        for name, path in (("ONCEFLOW_LAKE", self.lake), ("ONCEFLOW_HOME", self.home)):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigurationError(
                    f"{name} folder {path} cannot be created ({exc.strerror}); set {name} to a "
                    "writable folder."
                ) from None
            if not os.access(path, os.W_OK | os.X_OK):
                raise ConfigurationError(
                    f"{name} folder {path} is not writable; set {name} to a writable folder or "
                    "fix its permissions."
                )
        if not self.landing.is_dir():
            if create and not os.environ.get("ONCEFLOW_LANDING"):
                self.landing.mkdir(parents=True, exist_ok=True)
            else:
                raise ConfigurationError(
                    f"landing folder {self.landing} does not exist; create it or set "
                    "ONCEFLOW_LANDING to the folder producers write into."
                )
