"""Where the lake and the landing files live: a local folder or an S3 (or S3-compatible) prefix.

A `Location` is a folder-like place that every part of onceflow reaches the same way: pyarrow's
filesystem for files (on the driver and on the executors, no Hadoop), and delta-rs's storage
options for Delta tables. On S3 the Delta log is written with conditional puts
(`If-None-Match: *`), so two writers can never both create the same log entry, and no locking
service or "unsafe rename" is needed.

S3 settings come from the usual environment variables: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` (or `AWS_DEFAULT_REGION`) and
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for an S3-compatible store. They are kept out of
every `repr`, message and log line.
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlparse

from onceflow.errors import ConfigurationError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3 (or S3-compatible) store. Secrets never appear in `repr`."""

    region: str = DEFAULT_REGION
    endpoint: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> S3Options:
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        if endpoint is not None:
            parsed = urlparse(endpoint)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigurationError(
                    "AWS_ENDPOINT_URL must be an http:// or https:// address such as "
                    "http://localhost:9000"
                )
        return cls(
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION,
            endpoint=endpoint,
            access_key=env.get("AWS_ACCESS_KEY_ID") or None,
            secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
            session_token=env.get("AWS_SESSION_TOKEN") or None,
        )

    def filesystem(self) -> pafs.FileSystem:
        import pyarrow.fs as pafs

        kwargs: dict[str, object] = {"region": self.region}
        if self.endpoint:
            parsed = urlparse(self.endpoint)
            kwargs["endpoint_override"] = parsed.netloc
            kwargs["scheme"] = parsed.scheme
            # An S3-compatible server answers under its own address, not a bucket subdomain.
            kwargs["force_virtual_addressing"] = False
        if self.access_key and self.secret_key:
            kwargs["access_key"] = self.access_key
            kwargs["secret_key"] = self.secret_key
            if self.session_token:
                kwargs["session_token"] = self.session_token
        # A lost answer is retried a bounded number of times, then the step fails (and the
        # protocol recovers it); it never hangs a window.
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=5)
        kwargs["connect_timeout"] = 10
        kwargs["request_timeout"] = 60
        return pafs.S3FileSystem(**kwargs)  # type: ignore[arg-type]

    def delta_options(self) -> dict[str, str]:
        """delta-rs storage options: conditional puts for the log, the endpoint and keys."""
        options = {"AWS_REGION": self.region, "conditional_put": "etag"}
        if self.endpoint:
            options["AWS_ENDPOINT_URL"] = self.endpoint
            if self.endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        if self.access_key and self.secret_key:
            options["AWS_ACCESS_KEY_ID"] = self.access_key
            options["AWS_SECRET_ACCESS_KEY"] = self.secret_key
            if self.session_token:
                options["AWS_SESSION_TOKEN"] = self.session_token
        return options


@dataclass(frozen=True)
class Location:
    """A folder on the local disk or under an S3 bucket.

    Attributes:
        uri: An absolute local path (`/data/lake`) or `s3://bucket/prefix` (no trailing slash).
        s3: How to reach the store, for S3 locations.
    """

    uri: str
    s3: S3Options | None = None

    @classmethod
    def parse(
        cls, text: str, env: Mapping[str, str] | None = None, *, setting: str = ""
    ) -> Location:
        """A location from a setting's value: a local folder or `s3://bucket[/prefix]`.

        Raises:
            ConfigurationError: The scheme is not supported or the bucket is missing.
        """
        env = os.environ if env is None else env
        parsed = urlparse(text)
        name = setting or "the location"
        if len(parsed.scheme) <= 1:  # no scheme, or a Windows drive letter
            return cls(str(Path(text).expanduser().absolute()))
        if parsed.scheme == "file":
            return cls(str(Path(parsed.path).absolute()))
        if parsed.scheme in ("s3", "s3a"):
            if not parsed.netloc:
                raise ConfigurationError(
                    f"{name} {text!r} names no bucket; write it as s3://bucket/prefix."
                )
            prefix = parsed.path.strip("/")
            uri = f"s3://{parsed.netloc}" + (f"/{prefix}" if prefix else "")
            return cls(uri, S3Options.from_env(env))
        raise ConfigurationError(
            f"{name} {text!r} uses {parsed.scheme}://, which onceflow does not support; use a "
            "local folder or s3://bucket/prefix (S3 or an S3-compatible store)."
        )

    # -- naming ---------------------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return self.s3 is None

    @property
    def path(self) -> Path:
        """The local folder (local locations only)."""
        if self.s3 is not None:
            raise TypeError(f"{self.uri} is not a local folder")
        return Path(self.uri)

    def __truediv__(self, part: str) -> Location:
        part = str(part).strip("/")
        if self.s3 is None:
            return Location(str(Path(self.uri) / part))
        return Location(f"{self.uri}/{part}", self.s3)

    def __str__(self) -> str:
        return self.uri

    def __fspath__(self) -> str:
        """A local location is a path (`Path(location)`, `open(location / name)`)."""
        return str(self.path)

    def as_uri(self) -> str:
        """A URI for metadata and lineage (`file:///…` or `s3://…`)."""
        return Path(self.uri).as_uri() if self.s3 is None else self.uri

    # -- access ---------------------------------------------------------------------------------

    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem holding this location (made anew: cheap, and picklable)."""
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem() if self.s3 is None else self.s3.filesystem()

    @property
    def fs_path(self) -> str:
        """This location's path on its `filesystem()` (`bucket/key` on S3)."""
        return self.uri if self.s3 is None else self.uri[len("s3://") :]

    def delta_options(self) -> dict[str, str] | None:
        """delta-rs storage options (None for a local folder)."""
        return None if self.s3 is None else self.s3.delta_options()

    def info(self) -> pafs.FileInfo:
        return self.filesystem().get_file_info(self.fs_path)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        """True for a folder; on S3, for a prefix with objects under it."""
        import pyarrow.fs as pafs

        if self.s3 is None:
            return self.path.is_dir()
        selector = pafs.FileSelector(self.fs_path, allow_not_found=True, recursive=False)
        return bool(self.filesystem().get_file_info(selector))

    def size(self) -> int:
        """The file's size in bytes.

        Raises:
            FileNotFoundError: There is no file here.
        """
        import pyarrow.fs as pafs

        info = self.info()
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(self.uri)
        return int(info.size or 0)

    def mtime_ns(self) -> int:
        import pyarrow.fs as pafs

        info = self.info()
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(self.uri)
        return int(info.mtime_ns or 0)

    def read_bytes(self) -> bytes:
        with self.filesystem().open_input_stream(self.fs_path) as stream:
            return stream.read()

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file at once: on S3 one PUT, so readers see all of it or nothing;
        locally a temporary file renamed into place."""
        if self.s3 is None:
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            tmp.replace(self.path)
            return
        with self.filesystem().open_output_stream(self.fs_path) as stream:
            stream.write(data)

    def mkdir(self) -> None:
        """Create the folder (S3 has no folders: nothing to do)."""
        if self.s3 is None:
            self.path.mkdir(parents=True, exist_ok=True)

    def delete_tree(self) -> None:
        """Remove everything under this location; nothing there is fine."""
        fs = self.filesystem()
        try:
            fs.delete_dir(self.fs_path)
        except FileNotFoundError:
            pass
        except OSError:
            if self.is_dir():
                raise

    def files(self, *, recursive: bool = False) -> list[pafs.FileInfo]:
        """The files under this location (none if it does not exist), in path order."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.fs_path, allow_not_found=True, recursive=recursive)
        infos = self.filesystem().get_file_info(selector)
        return sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)

    def children(self, pattern_prefix: str = "") -> list[str]:
        """Names of the entries directly under this location that start with `pattern_prefix`."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.fs_path, allow_not_found=True, recursive=False)
        names = (posixpath.basename(i.path) for i in self.filesystem().get_file_info(selector))
        return sorted(n for n in names if n.startswith(pattern_prefix))


def open_input(root: str, rel: str) -> BinaryIO:
    """A file under `root` (a folder or `s3://` URI) opened for reading, on any process.

    Executors call this with a root from a data source's options, so an S3 root is reached
    with the executor's own `AWS_*` environment, as any S3 client on it would be.
    """
    return open_file(Location.parse(root) / rel)


def open_file(path: Path | Location) -> BinaryIO:
    """A local file or an object opened for reading (an object is fetched whole, into a
    seekable buffer that serves line readers and Parquet alike)."""
    if isinstance(path, Path) or path.is_local:
        return open(path, "rb")  # the caller closes it
    return io.BytesIO(path.read_bytes())
