"""A local S3-compatible server (moto's), for the demo and the tests of an object-store lake.

It is the `moto[s3]` package's server, run as a child process in its own process group. Its
S3 API keeps conditional writes (`If-None-Match: *` answers 412 when the object exists), which
is what delta-rs needs to commit safely. State lives in memory: a stopped server forgets every
object, so it suits tests and demos, never data that must outlive it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from onceflow.errors import ConfigurationError
from onceflow.spark_server import DEFAULT_HOST, free_port, stop_group

# moto accepts any key pair; these name the local server and grant nothing anywhere else.
LOCAL_ACCESS_KEY = "onceflow-local"
LOCAL_SECRET_KEY = "onceflow-local-secret"
LOCAL_REGION = "us-east-1"


@dataclass
class LocalS3:
    """A running local S3 server.

    Attributes:
        host: The address it listens on.
        port: Its port.
        log: Where its output goes (None: discarded).
    """

    host: str = DEFAULT_HOST
    port: int = 0
    log: Path | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The `AWS_*` settings that point a run at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": LOCAL_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": LOCAL_SECRET_KEY,
            "AWS_REGION": LOCAL_REGION,
        }

    def start(self, timeout_s: float = 60.0) -> LocalS3:
        try:
            import moto.server  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "the local S3 server needs the moto package; install onceflow's dev extras "
                "(pip install -e '.[dev]')."
            ) from None
        if not self.port:
            self.port = free_port(self.host)
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while not self.up():
            if self._proc.poll() is not None:
                raise RuntimeError(f"the local S3 server exited with {self._proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the local S3 server did not answer on {self.endpoint}")
            time.sleep(0.2)
        return self

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def create_bucket(self, bucket: str) -> None:
        """Create `bucket` (nothing to do if it exists)."""
        import pyarrow.fs as pafs

        from onceflow.storage import S3Options

        options = S3Options.from_env(self.env())
        pafs.S3FileSystem(
            access_key=options.access_key,
            secret_key=options.secret_key,
            region=options.region,
            endpoint_override=f"{self.host}:{self.port}",
            scheme="http",
            allow_bucket_creation=True,
        ).create_dir(bucket)

    def stop(self) -> None:
        if self._proc is not None:
            stop_group(self._proc, timeout_s=10)
            self._proc = None

    def __enter__(self) -> LocalS3:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
