"""A Delta table's log as a `DeltaTableSource` reads it: where the table and its files live, its
versions and commit files, a commit's token, the protocol features it can read, and the
problems that say a table was recreated or restored (see `onceflow.sources.delta`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from onceflow.errors import SourceError
from onceflow.storage import Location

if TYPE_CHECKING:
    from deltalake import DeltaTable

_VERSION_DIGITS = 20
_COMMIT_RE = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT_RE = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?(\.[^.]+)?\.parquet$")
# Reader features whose data this source reads correctly: they change nothing about the rows in
# the data files (or only how the log is stored, which delta-rs reads for us). Any other reader
# feature is refused rather than misread.
_HANDLED_READER_FEATURES = frozenset(
    {"timestampNtz", "vacuumProtocolCheck", "v2Checkpoint", "typeWidening", "typeWidening-preview"}
)
_MAX_READER_VERSION = 3
# Hex digits of a commit token: 64 bits tell two different log entries apart.
_TOKEN_CHARS = 16
# What a window's offsets record about the table, besides its version range (windows planned
# before these existed have neither and are checked by version only).
TABLE_ID = "table_id"
COMMITS = "commits"
RESTATE_FIX = (
    "to follow the table as it is now, restate the job's windows from it: `onceflow restate "
    "<job> --source-replaced` reads again every window whose versions changed and replaces its "
    "effect in every sink; then run the job again"
)


def version_unit(version: int) -> str:
    """The unit name of a table version (zero-padded, so string order is version order).

    Args:
        version: A Delta table version (>= 0).
    """
    return f"{version:0{_VERSION_DIGITS}d}"


# -- locations ------------------------------------------------------------------------------------


def _is_uri(path: str) -> bool:
    # A one-letter scheme is a Windows drive, not a URI.
    return len(urlparse(path).scheme) > 1


def _filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding `root` and the path of `root` on it.

    An `s3://` root is reached with the S3 settings of the process's environment (`AWS_*`, see
    `onceflow.storage`); on executors that is their own environment, as for any S3 client.
    """
    if _is_uri(root):
        if urlparse(root).scheme in ("s3", "s3a"):
            location = Location.parse(root)
            return location.filesystem(), location.fs_path
        return pafs.FileSystem.from_uri(root)
    return pafs.LocalFileSystem(), root


def _data_file_location(
    fs: pafs.FileSystem, base: str, log_path: str
) -> tuple[pafs.FileSystem, str]:
    """Where a data file named `log_path` in the log lives (relative paths are URI-encoded)."""
    if _is_uri(log_path):
        return _filesystem(log_path)
    return fs, f"{base.rstrip('/')}/{unquote(log_path)}"


def _source_name(version: int, log_path: str) -> str:
    return f"v{version}/{log_path if _is_uri(log_path) else unquote(log_path)}"


# -- the log --------------------------------------------------------------------------------------


def _latest_version(fs: pafs.FileSystem, base: str) -> int | None:
    """The newest version in `_delta_log` (None when there is no table), by listing only."""
    selector = pafs.FileSelector(f"{base.rstrip('/')}/_delta_log", allow_not_found=True)
    latest: int | None = None
    for info in fs.get_file_info(selector):
        match = _COMMIT_RE.match(info.base_name) or _CHECKPOINT_RE.match(info.base_name)
        if match:
            version = int(match.group(1))
            latest = version if latest is None else max(latest, version)
    return latest


def _read_entry(fs: pafs.FileSystem, base: str, version: int) -> bytes | None:
    """The bytes of one commit file (None when the file is gone)."""
    path = f"{base.rstrip('/')}/_delta_log/{version_unit(version)}.json"
    try:
        with fs.open_input_stream(path) as stream:
            return bytes(stream.read())
    except FileNotFoundError:
        return None


def _actions(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _read_commit(fs: pafs.FileSystem, base: str, version: int) -> list[dict[str, Any]] | None:
    """The actions of one commit file, in file order (None when the file is gone)."""
    data = _read_entry(fs, base, version)
    return None if data is None else _actions(data)


def commit_token(data: bytes) -> str:
    """What identifies one commit: a digest of its log entry. A log entry is written once and
    never changed, so the same version of the same table always has the same token, and a
    version of a recreated table or of a restored older copy that was extended has another."""
    return hashlib.sha256(data).hexdigest()[:_TOKEN_CHARS]


def _commit_mtime(fs: pafs.FileSystem, base: str, version: int) -> float | None:
    info = fs.get_file_info(f"{base.rstrip('/')}/_delta_log/{version_unit(version)}.json")
    if info.type == pafs.FileType.NotFound or info.mtime is None:
        return None
    return info.mtime.timestamp()


@dataclass(frozen=True)
class _DataFile:
    """One data file a window reads: its version, its log path and what its rows mean."""

    version: int
    path: str
    # +1 for an added file, -1 for a removed one, 0 for a change data file (sign per row).
    change: int
    partition_values: dict[str, str | None]
    size: int | None = None

    def to_json(self) -> list[Any]:
        return [self.version, self.path, self.change, self.partition_values]


@dataclass
class _Plan:
    """What the driver learnt from a window's commits."""

    problems: dict[str, None] = field(default_factory=dict)  # ordered set
    files: list[_DataFile] = field(default_factory=list)
    snapshot: DeltaTable | None = None

    def problem(self, text: str) -> None:
        self.problems[text] = None


def _hive_partition_values(path: str, columns: Sequence[str]) -> dict[str, str | None] | None:
    """Partition values from a Hive-style path (`k=v/…`), or None if one is missing."""
    found: dict[str, str | None] = {}
    for segment in unquote(path).split("/")[:-1]:
        key, sep, value = segment.partition("=")
        if sep:
            value = unquote(value)
            found[unquote(key)] = None if value == "__HIVE_DEFAULT_PARTITION__" else value
    if any(column not in found for column in columns):
        return None
    return {column: found[column] for column in columns}


def _feature_problems(
    version: int,
    min_reader: int | None,
    reader_features: Sequence[str] | None,
    configuration: Mapping[str, Any] | None,
) -> list[str]:
    """Why a protocol/configuration cannot be read by this source (empty when it can)."""
    problems = []
    features = set(reader_features or ())
    if "deletionVectors" in features:
        problems.append(
            f"version {version}: the table uses deletion vectors (reader feature "
            "`deletionVectors`), which this source cannot apply; drop the feature upstream "
            "(`ALTER TABLE … DROP FEATURE deletionVectors` purges them), or read a copy of the "
            "table written without deletion vectors"
        )
    if "columnMapping" in features or (
        str((configuration or {}).get("delta.columnMapping.mode", "none")).lower() != "none"
    ):
        problems.append(
            f"version {version}: the table uses column mapping "
            "(`delta.columnMapping.mode`), which this source cannot read; read a table "
            "without column mapping (rewrite it with mode `none`)"
        )
    unknown = sorted(features - _HANDLED_READER_FEATURES - {"deletionVectors", "columnMapping"})
    if unknown:
        problems.append(
            f"version {version}: the table needs reader features this source does not handle "
            f"({', '.join(unknown)}); read a copy of the table without them"
        )
    elif min_reader is not None and min_reader > _MAX_READER_VERSION:
        problems.append(
            f"version {version}: the table needs Delta reader version {min_reader}, above the "
            f"{_MAX_READER_VERSION} this source reads; read a copy written for an older protocol"
        )
    return problems


def _parse_unit(table: str, unit: str) -> int:
    if len(unit) != _VERSION_DIGITS or not unit.isdigit():
        raise SourceError(
            f"Delta table `{table}`: unit {unit!r} is not a table version (20 digits); plan "
            "windows from the units `discover` returns."
        )
    return int(unit)


def _table_id(root: str, version: int) -> str | None:
    """The table's id (its metadata's `id`) at `version`, None if that cannot be loaded."""
    try:
        return str(_snapshot(root, version).metadata().id)
    except Exception:  # delta-rs raises several types; the read reports what is wrong
        return None


def _renumbered(end: int, latest: int) -> str:
    return (
        f"version {end} is not in the table any more (its newest version is {latest}): the table "
        "was recreated or restored from an older copy, and its versions renumbered"
    )


def _id_problems(version: int, recorded: str, now: str | None) -> list[str]:
    if now is None or now == recorded:
        return []
    return [
        f"version {version} is of another table than the one read (table id {now}, recorded "
        f"{recorded}): the table was deleted and created again"
    ]


def _token_problems(version: int, recorded: str, now: str) -> list[str]:
    if now == recorded:
        return []
    return [
        f"version {version} is another commit than the one read (commit token {now}, recorded "
        f"{recorded}): the table was recreated or restored from an older copy, and its versions "
        "renumbered"
    ]


def _snapshot(root: str, version: int) -> DeltaTable:
    from onceflow._delta_read import open_table

    return open_table(root, version)


def _schema_before(root: str, start: int) -> tuple[Any, list[str]] | None:
    """The schema and partition columns of the snapshot just before `start` (None if gone)."""
    if start <= 0:
        return None
    try:
        snapshot = _snapshot(root, start - 1)
    except Exception:  # a cleaned-up log: the caller reports it
        return None
    return snapshot.schema(), list(snapshot.metadata().partition_columns)


def _check_files_exist(plan: _Plan, fs: pafs.FileSystem, base: str) -> None:
    """Adds a problem to `plan` for each of its data files that is gone."""
    located = [_data_file_location(fs, base, f.path) for f in plan.files]
    # One batched lookup per filesystem: an object store answers many paths per request.
    by_fs: dict[int, tuple[pafs.FileSystem, list[int]]] = {}
    for index, (file_fs, _) in enumerate(located):
        by_fs.setdefault(id(file_fs), (file_fs, []))[1].append(index)
    for file_fs, indexes in by_fs.values():
        infos = file_fs.get_file_info([located[i][1] for i in indexes])
        for index, info in zip(indexes, infos, strict=True):
            if info.type == pafs.FileType.NotFound:
                data_file = plan.files[index]
                what = {1: "added", -1: "removed", 0: "change data"}[data_file.change]
                plan.problem(
                    f"version {data_file.version}: {what} file {data_file.path} is gone "
                    "(vacuumed), so its rows cannot be replayed; vacuum the upstream table "
                    "with a retention longer than the downstream lag, and reconcile to "
                    "report this window as unverifiable"
                )
