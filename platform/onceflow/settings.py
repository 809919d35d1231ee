"""Settings from the environment (`ONCEFLOW_*`), checked when they are loaded."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from onceflow.errors import ConfigurationError
from onceflow.storage import Location


@dataclass(frozen=True)
class Settings:
    """Where onceflow keeps its state and finds its input.

    Attributes:
        home: Folder for embedded state (`ONCEFLOW_HOME`, default `.onceflow`).
        postgres_dsn: DSN of the PostgreSQL holding the sinks and the ledger; `None` means an
            embedded server under `home/postgres`. Never printed.
        lake: Root of the Delta tables and onceflow's staged outputs (`ONCEFLOW_LAKE`, default
            `home/lake`): a local folder or `s3://bucket/prefix` (see `onceflow.storage`).
        landing: Root folder of the landing files (`ONCEFLOW_LANDING`, default `home/landing`).
    """

    home: Path
    postgres_dsn: str | None
    lake: Location  # a Path or text given here is parsed into a Location
    landing: Location  # likewise

    def __post_init__(self) -> None:
        # A folder given as a path (or text) is a location too.
        for name in ("lake", "landing"):
            value = getattr(self, name)
            if not isinstance(value, Location):
                object.__setattr__(self, name, Location.parse(str(value), setting=name))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from `env` (default `os.environ`)."""
        env = os.environ if env is None else env
        home = Path(env.get("ONCEFLOW_HOME") or ".onceflow").absolute()
        dsn = env.get("ONCEFLOW_POSTGRES_DSN") or None
        lake = Location.parse(
            env.get("ONCEFLOW_LAKE") or str(home / "lake"), env, setting="ONCEFLOW_LAKE"
        )
        landing = Location.parse(
            env.get("ONCEFLOW_LANDING") or str(home / "landing"), env, setting="ONCEFLOW_LANDING"
        )
        return cls(home=home, postgres_dsn=dsn, lake=lake, landing=landing)

    def __repr__(self) -> str:
        dsn = "<set>" if self.postgres_dsn else "<embedded>"
        return f"Settings(home={self.home}, postgres_dsn={dsn}, lake={self.lake}, landing={self.landing})"

    def check_folders(self, *, create: bool = True) -> None:
        """Make sure the lake is writable and the landing folder exists."""
        folders = [("ONCEFLOW_HOME", self.home)]
        if self.lake.is_local:
            folders.insert(0, ("ONCEFLOW_LAKE", self.lake.path))
        else:
            _check_bucket(self.lake, "ONCEFLOW_LAKE")
        for name, path in folders:
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
        if not self.landing.is_local:
            # An object store has no folders: an empty prefix is an empty landing folder.
            _check_bucket(self.landing, "ONCEFLOW_LANDING")
        elif not self.landing.is_dir():
            if create and not os.environ.get("ONCEFLOW_LANDING"):
                self.landing.mkdir()
            else:
                raise ConfigurationError(
                    f"landing folder {self.landing} does not exist; create it or set "
                    "ONCEFLOW_LANDING to the folder producers write into."
                )


def _check_bucket(lake: Location, setting: str) -> None:
    """Fail at load time, with what to fix, when an object-store location cannot be reached."""
    import pyarrow.fs as pafs

    bucket = lake.fs_path.split("/", 1)[0]
    where = lake.s3.endpoint if lake.s3 and lake.s3.endpoint else "AWS S3"
    try:
        info = lake.filesystem().get_file_info(bucket)
    except OSError as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigurationError(
            f"{setting} {lake.uri}: the bucket cannot be reached at {where} ({reason}); "
            "check AWS_ENDPOINT_URL, AWS_REGION and the AWS credentials."
        ) from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigurationError(
            f"{setting} {lake.uri}: bucket {bucket!r} does not exist at {where}; create it "
            f"or point {setting} at an existing bucket."
        )
