"""Delta tables read by version: one job's Delta output feeds the next job exactly once.

A unit is a table version (a zero-padded 20-digit string, so string order is version order) and
a window's offsets are a contiguous version range. Every logical change a version makes reaches
the job once, as signed rows:

- rows of a file a version adds (`add`, `dataChange: true`) arrive with `_change = +1`;
- rows of a file a version removes (`remove`, `dataChange: true`) arrive with `_change = -1`, so
  a restatement or a repair that rewrites files (remove a file, add a rewritten copy without some
  rows, add new files) nets out to exactly what changed, and a downstream job that accumulates
  follows the table's current content;
- a version that carries change data files (`cdc`, written for DML when
  `delta.enableChangeDataFeed` is on) is read from those instead of its add/remove actions:
  `insert`/`update_postimage` rows are +1, `delete`/`update_preimage` rows are -1;
- actions with `dataChange: false` (compaction, checkpoints of the same rows) are not changes and
  are skipped; a version without actions (an epoch claim) gives no rows.

Spark's own Delta streaming source fails on versions that remove data, or skips them; this one
reads them, and what it cannot express (a cleaned-up log, a vacuumed file, deletion vectors,
column mapping, a schema change inside a window) is a `SourceError` naming the version.

Version numbers alone do not say which table they are of: a table deleted and created again, or
restored from an older copy and then written to, numbers new commits like the ones a job already
read. So a window's offsets also record the table's id and each version's commit token (a digest
of its log entry); a replay compares every version of the window, and planning past a window
compares the table id and the window's last version, and a mismatch is a `SourceError` naming
the version and the recovery (`onceflow restate <job> --source-replaced`, which re-points each
changed window at the table as it is now and replaces its effect; see `rebased`).

The driver parses the window's commit files (small JSON); executors read the data files, one
Spark partition per file, through a Spark Python data source yielding Arrow batches. The frame
has the table's columns (schema of the snapshot at the window's end version; partition values
from the log), then `_change INT`, `_commit_version BIGINT`, the position columns (`_file_idx`,
`_source_file` = `v<version>/<data file>`, `_source_line`) and `_reason`/`_raw_text` (always null:
a Delta table's rows are typed). A table column whose name is one of these (an onceflow table
keeps its own `_source_file`, `_source_line`) is renamed with an `_upstream` prefix
(`_upstream_source_file`), so the upstream job's positions stay available.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from onceflow.errors import SourceError
from onceflow.sources.base import Observation, Source
from onceflow.storage import Location

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from onceflow.settings import Settings

#: Columns the source adds after the table's own, in this order.
EXTRA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("_change", "INT"),
    ("_commit_version", "BIGINT"),
    ("_file_idx", "INT"),
    ("_source_file", "STRING"),
    ("_source_line", "BIGINT"),
    ("_reason", "STRING"),
    ("_raw_text", "STRING"),
)
#: Prefix given to a table column whose name is one of EXTRA_COLUMNS.
UPSTREAM_PREFIX = "_upstream"

_VERSION_DIGITS = 20
_COMMIT_RE = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT_RE = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?(\.[^.]+)?\.parquet$")
# `_change_type` values of change data files, by the sign they give a row.
_CDC_PLUS = ("insert", "update_postimage")
_CDC_MINUS = ("delete", "update_preimage")
# Reader features whose data this source reads correctly: they change nothing about the rows in
# the data files (or only how the log is stored, which delta-rs reads for us). Any other reader
# feature is refused rather than misread.
_HANDLED_READER_FEATURES = frozenset(
    {"timestampNtz", "vacuumProtocolCheck", "v2Checkpoint", "typeWidening", "typeWidening-preview"}
)
_MAX_READER_VERSION = 3
_BATCH_ROWS = 10_000
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


# -- the source -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaTableSource(Source):
    """A Delta table read by version range, removals included.

    Attributes:
        table: The table's name; it lives at `<lake>/<table>` unless `path` is given.
        path: Where the table lives, when not in the lake: a local folder (or, later, a URI).
    """

    table: str
    path: str | None = None

    kind = "delta"
    typed = True

    def describe(self) -> str:
        return f"Delta table `{self.table}` (by version)"

    @property
    def lake_table(self) -> str | None:
        return self.table if self.path is None else None

    def root(self, settings: Settings) -> str:
        """The table's location: an absolute local folder, or a URI.

        Args:
            settings: Where the lake is.
        """
        if self.path is None:
            return (settings.lake / self.table).uri
        if _is_uri(self.path):
            return self.path.rstrip("/")
        # Absolute on the driver: executors may run in another working directory.
        return str(Path(self.path).absolute())

    def current_version(self, settings: Settings) -> int | None:
        """The table's newest version, or None when there is no table (no Spark, no snapshot).

        Args:
            settings: Where the lake is.
        """
        fs, base = _filesystem(self.root(settings))
        return _latest_version(fs, base)

    # -- planning ---------------------------------------------------------------------------------

    def discover(self, settings: Settings, after: Mapping[str, Any] | None = None) -> list[str]:
        """Versions after the last planned window's end, up to the table's current version.

        Args:
            settings: Where the lake is.
            after: The last planned window's offsets (its `end` is skipped past), or None.
        """
        latest = self.current_version(settings)
        if latest is None:
            return []
        first = 0
        if after is not None and after.get("end") is not None:
            self._check_continues(settings, after, latest)
            first = int(after["end"]) + 1
        return [version_unit(v) for v in range(first, latest + 1)]

    def _check_continues(self, settings: Settings, after: Mapping[str, Any], latest: int) -> None:
        """Refuse to plan past `after` unless the table is still the one `after` was read from:
        a recreated or restored table renumbers its versions, and reading on from `end + 1`
        would skip new versions (lost) or read replayed ones (doubled)."""
        end = int(after["end"])
        problems: list[str] = []
        if latest < end:
            problems.append(_renumbered(end, latest))
        else:
            root = self.root(settings)
            fs, base = _filesystem(root)
            recorded_id = after.get(TABLE_ID)
            if recorded_id is not None:
                problems += _id_problems(end, recorded_id, _table_id(root, latest))
            tokens = after.get(COMMITS) or []
            if len(tokens) == end - int(after["start"]) + 1 and tokens[-1] is not None:
                data = _read_entry(fs, base, end)
                # An entry cleaned up since cannot be compared; the table id still is.
                if data is not None:
                    problems += _token_problems(end, tokens[-1], commit_token(data))
        if problems:
            raise SourceError(
                f"Delta table `{self.table}` is not the table this job read up to version "
                f"{end}: " + "; ".join(problems) + f". Nothing was planned; {RESTATE_FIX}."
            )

    def offsets(self, settings: Settings, units: Sequence[str]) -> dict[str, Any]:
        """The version range `{"table", "start", "end"}` of a window made of `units`.

        With them, what the versions are: the table's id (`table_id`, from its metadata) and
        each version's commit token (`commits`, in version order; null for an entry that is
        gone), which replays and later planning compare with the table as it is then.

        Args:
            settings: Where the lake is.
            units: Padded versions; they must form one contiguous range.

        Raises:
            SourceError: When `units` is empty, malformed or has gaps.
        """
        if not units:
            raise SourceError(
                f"Delta table `{self.table}`: a window needs at least one version; plan it "
                "from the versions `discover` returns."
            )
        versions = sorted(_parse_unit(self.table, unit) for unit in units)
        for before, after in pairwise(versions):
            if after != before + 1:
                raise SourceError(
                    f"Delta table `{self.table}`: a window's versions must be contiguous, got "
                    f"{before} then {after}; plan every version between them into windows in "
                    "order."
                )
        start, end = versions[0], versions[-1]
        return {
            "table": self.table,
            "start": start,
            "end": end,
            **self._identity(settings, start, end),
        }

    def _identity(self, settings: Settings, start: int, end: int) -> dict[str, Any]:
        """The table id and the commit tokens of versions `start`..`end`, as the table is now."""
        root = self.root(settings)
        fs, base = _filesystem(root)
        tokens = []
        for version in range(start, end + 1):
            data = _read_entry(fs, base, version)
            tokens.append(None if data is None else commit_token(data))
        return {TABLE_ID: _table_id(root, end), COMMITS: tokens}

    def rebased(self, settings: Settings, offsets: Mapping[str, Any]) -> dict[str, Any] | None:
        """The window's offsets for the table as it is now, if it is not the one they recorded
        (None: the same table id and commits). Offsets planned before identities were recorded
        are always given the table's: nothing says what they read.

        Args:
            settings: Where the lake is.
            offsets: The window's version range, as recorded.

        Raises:
            SourceError: The table does not have the window's versions (yet).
        """
        start, end = int(offsets["start"]), int(offsets["end"])
        latest = self.current_version(settings)
        if latest is None or latest < end:
            newest = "it is missing" if latest is None else f"its newest version is {latest}"
            raise SourceError(
                f"Delta table `{self.table}`: versions {start}..{end} cannot be read again from "
                f"the table as it is now ({newest}). Restate when the table has version {end} "
                "(each commit to it adds one), or start the job over (empty its sinks, drop "
                "its windows) to read the table from version 0."
            )
        identity = self._identity(settings, start, end)
        if all(offsets.get(k) == v for k, v in identity.items()):
            return None
        return {**offsets, **identity}

    def units(self, offsets: Mapping[str, Any]) -> list[str]:
        """The padded versions `start`..`end` of a window's offsets.

        Args:
            offsets: A window's version range, as `offsets` made it.
        """
        start, end = offsets.get("start"), offsets.get("end")
        if start is None or end is None:
            return []
        return [version_unit(v) for v in range(int(start), int(end) + 1)]

    # -- replay checks ----------------------------------------------------------------------------

    def check_available(self, settings: Settings, offsets: Mapping[str, Any]) -> list[str]:
        """Why the window's versions cannot be read exactly as planned (empty when they can).

        Args:
            settings: Where the lake is.
            offsets: The window's version range.
        """
        return list(self._plan(settings, offsets).problems)

    def _plan(self, settings: Settings, offsets: Mapping[str, Any]) -> _Plan:
        plan = _Plan()
        if offsets.get("table", self.table) != self.table:
            plan.problem(
                f"the window's offsets are for table `{offsets.get('table')}`, not "
                f"`{self.table}`; the job's source was changed after planning: restore it"
            )
            return plan
        try:
            start, end = int(offsets["start"]), int(offsets["end"])
        except (KeyError, TypeError, ValueError):
            plan.problem(f"offsets {dict(offsets)!r} hold no version range `start`..`end`")
            return plan
        root = self.root(settings)
        fs, base = _filesystem(root)
        latest = _latest_version(fs, base)
        if latest is None:
            plan.problem(
                f"Delta table `{self.table}` is missing at {root}; restore it, or check "
                "ONCEFLOW_LAKE and that the upstream job has run"
            )
            return plan
        if end > latest:
            plan.problem(f"{_renumbered(end, latest)}; {RESTATE_FIX}")
            return plan

        tokens = offsets.get(COMMITS)
        if not isinstance(tokens, list) or len(tokens) != end - start + 1:
            tokens = [None] * (end - start + 1)  # planned before tokens were recorded
        commits: list[tuple[int, list[dict[str, Any]]]] = []
        for version, recorded in zip(range(start, end + 1), tokens, strict=True):
            try:
                data = _read_entry(fs, base, version)
                actions = None if data is None else _actions(data)
            except (ValueError, OSError) as exc:
                plan.problem(
                    f"version {version}: commit file {version_unit(version)}.json cannot be "
                    f"read ({exc}); repair the table's log"
                )
                continue
            if data is not None and recorded is not None:
                changed = _token_problems(version, recorded, commit_token(data))
                for text in changed:
                    plan.problem(f"{text}; {RESTATE_FIX}")
                if changed:
                    continue
            if actions is None:
                plan.problem(
                    f"version {version}: commit file _delta_log/{version_unit(version)}.json is "
                    "gone (log cleanup after `delta.logRetentionDuration`), so its changes "
                    "cannot be replayed; keep the upstream log longer than the downstream lag, "
                    "and reconcile to report this window as unverifiable"
                )
                continue
            commits.append((version, actions))

        try:
            plan.snapshot = _snapshot(root, end)
        except Exception as exc:  # delta-rs raises several types; all mean "cannot load"
            plan.problem(
                f"version {end}: the table's snapshot cannot be loaded ({exc}); repair the "
                "table or reconcile to report this window as unverifiable"
            )
        if plan.snapshot is not None and offsets.get(TABLE_ID) is not None:
            for text in _id_problems(end, offsets[TABLE_ID], plan.snapshot.metadata().id):
                plan.problem(f"{text}; {RESTATE_FIX}")
        if plan.snapshot is not None:
            protocol = plan.snapshot.protocol()
            for text in _feature_problems(
                end,
                protocol.min_reader_version,
                protocol.reader_features,
                plan.snapshot.metadata().configuration,
            ):
                plan.problem(text)

        partition_columns: list[str] = (
            list(plan.snapshot.metadata().partition_columns) if plan.snapshot else []
        )
        previous_schema: tuple[Any, list[str]] | None = None
        for version, actions in commits:
            previous_schema = self._check_log_actions(
                plan, root, version, start, actions, previous_schema
            )
            plan.files.extend(self._data_files(plan, version, actions, partition_columns))

        self._check_files_exist(plan, fs, base)
        return plan

    def _check_log_actions(
        self,
        plan: _Plan,
        root: str,
        version: int,
        start: int,
        actions: list[dict[str, Any]],
        previous_schema: tuple[Any, list[str]] | None,
    ) -> tuple[Any, list[str]] | None:
        """Record problems with the protocol, metadata and deletion vectors of one commit."""
        from deltalake import Schema

        for action in actions:
            if "protocol" in action:
                protocol = action["protocol"] or {}
                for text in _feature_problems(
                    version,
                    protocol.get("minReaderVersion"),
                    protocol.get("readerFeatures"),
                    None,
                ):
                    plan.problem(text)
            for kind in ("add", "remove"):
                if (action.get(kind) or {}).get("deletionVector"):
                    plan.problem(
                        f"version {version}: `{kind}` of {action[kind].get('path')} carries a "
                        "deletion vector, which this source cannot apply; drop the feature "
                        "upstream (`ALTER TABLE … DROP FEATURE deletionVectors` purges them), "
                        "or read a copy of the table written without deletion vectors"
                    )
            if "metaData" not in action:
                continue
            meta = action["metaData"] or {}
            for text in _feature_problems(version, None, None, meta.get("configuration")):
                plan.problem(text)
            try:
                schema = Schema.from_json(meta.get("schemaString") or "")
            except Exception as exc:  # a schema delta-rs cannot parse is unreadable here too
                plan.problem(f"version {version}: the table's schema cannot be parsed ({exc})")
                continue
            current = (schema, list(meta.get("partitionColumns") or []))
            if version == 0:
                previous_schema = current
                continue
            if previous_schema is None:
                previous_schema = _schema_before(root, start)
            if previous_schema is None:
                plan.problem(
                    f"version {version}: the table's metadata changes, and its schema before "
                    f"version {start} cannot be loaded to compare; restore the table's log"
                )
            elif previous_schema[0] != current[0] or previous_schema[1] != current[1]:
                plan.problem(
                    f"version {version}: the table's schema (or partitioning) changes, which a "
                    "running downstream job cannot take mid-stream; restore the old schema "
                    "upstream, or update the downstream job for the new schema and start it as "
                    f"a new job from version {version}"
                )
            previous_schema = current
        return previous_schema

    def _data_files(
        self,
        plan: _Plan,
        version: int,
        actions: list[dict[str, Any]],
        partition_columns: list[str],
    ) -> list[_DataFile]:
        """The files whose rows are version `version`'s logical changes, in action order."""
        cdc = [a["cdc"] for a in actions if a.get("cdc")]
        if cdc:
            # The change data files are the version's whole change (Delta's CDF rule); its
            # add/remove actions then only restate the copied rows.
            return [
                _DataFile(
                    version, c["path"], 0, dict(c.get("partitionValues") or {}), c.get("size")
                )
                for c in cdc
            ]
        files = []
        for action in actions:
            for kind, sign in (("add", 1), ("remove", -1)):
                entry = action.get(kind)
                if not entry or entry.get("dataChange", True) is False:
                    continue
                values = entry.get("partitionValues")
                if values is None and partition_columns:
                    values = _hive_partition_values(entry["path"], partition_columns)
                    if values is None:
                        plan.problem(
                            f"version {version}: `{kind}` of {entry['path']} has no partition "
                            "values and its path does not hold them; rewrite the commit with "
                            "a writer that records them"
                        )
                        continue
                files.append(
                    _DataFile(version, entry["path"], sign, dict(values or {}), entry.get("size"))
                )
        return files

    def _check_files_exist(self, plan: _Plan, fs: pafs.FileSystem, base: str) -> None:
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

    # -- reading ----------------------------------------------------------------------------------

    def read(
        self, spark: SparkSession, settings: Settings, offsets: Mapping[str, Any]
    ) -> DataFrame:
        """The window's changes as signed rows, read on the executors (one task per file).

        Args:
            spark: The session to read with (classic or Spark Connect).
            settings: Where the lake is.
            offsets: The window's version range.

        Raises:
            SourceError: When the versions cannot be read exactly as planned.
        """
        plan = self._plan(settings, offsets)
        if plan.problems:
            problems = list(plan.problems)
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise SourceError(
                f"Delta table `{self.table}`: window versions {offsets.get('start')}.."
                f"{offsets.get('end')} cannot be read as planned: "
                + "; ".join(problems[:5])
                + more
                + "."
            )
        assert plan.snapshot is not None
        schema, layout = _frame_schema(plan.snapshot)
        if not plan.files:
            return spark.createDataFrame([], schema)
        # Registered on every read: a Spark Connect session can change under us.
        spark.dataSource.register(_DeltaChangesDataSource)
        return (
            spark.read.format(_DeltaChangesDataSource.name())
            .option("root", self.root(settings))
            .option("schema", schema.json())
            .option("layout", json.dumps(layout))
            .option("files", json.dumps([f.to_json() for f in plan.files]))
            .load()
        )

    # -- observing --------------------------------------------------------------------------------

    def observe(self, settings: Settings) -> Observation:
        """The table's current version (`-1` when there is no table), from a log listing.

        Args:
            settings: Where the lake is.
        """
        latest = self.current_version(settings)
        current = -1 if latest is None else latest
        return Observation(
            version=str(current),
            units=current + 1,
            metadata={"table": self.table, "table_version": current},
        )

    def _commit_of(
        self, settings: Settings, unit: str
    ) -> tuple[Any, str, int, list[dict[str, Any]]] | None:
        """The filesystem, table base, version and commit actions of a unit, if readable."""
        fs, base = _filesystem(self.root(settings))
        try:
            version = int(unit)
            actions = _read_commit(fs, base, version)
        except (ValueError, OSError):
            return None
        return None if actions is None else (fs, base, version, actions)

    def unit_age_s(self, settings: Settings, unit: str) -> float | None:
        """Seconds since the version was committed (in-commit or commitInfo timestamp).

        Args:
            settings: Where the lake is.
            unit: A padded version.
        """
        found = self._commit_of(settings, unit)
        if found is None:
            return None
        fs, base, version, actions = found
        stamp: float | None = None
        for action in actions:
            info = action.get("commitInfo") or {}
            millis = info.get("inCommitTimestamp") or info.get("timestamp")
            if isinstance(millis, int | float):
                stamp = millis / 1000.0
                break
        if stamp is None:
            stamp = _commit_mtime(fs, base, version)
        return None if stamp is None else max(0.0, time.time() - stamp)

    def unit_size(self, settings: Settings, unit: str) -> int | None:
        """Bytes of the data files the version's changes are read from.

        Args:
            settings: Where the lake is.
            unit: A padded version.
        """
        found = self._commit_of(settings, unit)
        if found is None:
            return None
        _, _, version, actions = found
        files = self._data_files(_Plan(), version, actions, [])
        if any(f.size is None for f in files):
            return None
        return sum(f.size or 0 for f in files)


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


def _frame_schema(snapshot: DeltaTable) -> tuple[StructType, list[list[Any]]]:
    """The frame's Spark schema and, per table column, `[output name, table name, partition]`."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    arrow = pa.schema(snapshot.schema().to_arrow())
    partitions = set(snapshot.metadata().partition_columns)
    table_schema = from_arrow_schema(arrow)
    extras = {name for name, _ in EXTRA_COLUMNS}
    taken = set(arrow.names) | extras
    fields: list[StructField] = []
    layout: list[list[Any]] = []
    for spark_field in table_schema.fields:
        name = spark_field.name
        out = name
        while out in extras or (out != name and out in taken):
            out = UPSTREAM_PREFIX + out
        taken.add(out)
        # Nullable: a file written before a column existed has no values for it.
        fields.append(StructField(out, spark_field.dataType, True, spark_field.metadata))
        layout.append([out, name, name in partitions])
    spark_types = {"INT": IntegerType(), "BIGINT": LongType(), "STRING": StringType()}
    for name, ddl in EXTRA_COLUMNS:
        fields.append(StructField(name, spark_types[ddl], True))
    return StructType(fields), layout


# -- executors ------------------------------------------------------------------------------------


def _partition_array(value: str | None, target: pa.DataType, rows: int) -> pa.Array:
    """A column of `rows` copies of a partition value, parsed from the log's string form."""
    if value is None or (value == "" and not pa.types.is_string(target)):
        return pa.nulls(rows, target)
    text = pa.scalar(value, pa.string())
    if pa.types.is_timestamp(target) and target.tz is not None:
        try:
            scalar = text.cast(target)
        except pa.ArrowInvalid:
            # Delta writes UTC timestamps without an offset (`2024-01-02 03:04:05`).
            scalar = text.cast(pa.timestamp(target.unit)).cast(target)
    else:
        scalar = text.cast(target)
    return pa.repeat(scalar, rows)


def _signs(change_types: pa.Array, path: str) -> pa.Array:
    """+1/-1 per row of a change data file, from its `_change_type` column."""
    import pyarrow.compute as pc

    plus = pc.is_in(change_types, value_set=pa.array(_CDC_PLUS, pa.string()))
    minus = pc.is_in(change_types, value_set=pa.array(_CDC_MINUS, pa.string()))
    if not pc.all(pc.or_(plus, minus)).as_py():
        unknown = pc.unique(pc.filter(change_types, pc.invert(pc.or_(plus, minus))))
        raise SourceError(
            f"change data file {path} holds `_change_type` values {unknown.to_pylist()}, which "
            "are not Delta change types; repair the upstream table's change data"
        )
    return pc.if_else(plus, pa.scalar(1, pa.int32()), pa.scalar(-1, pa.int32()))


def _read_data_file(
    root: str,
    file_idx: int,
    entry: list[Any],
    layout: list[list[Any]],
    target: pa.Schema,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches of one data file in the frame's schema, with its signs and positions."""
    import pyarrow.parquet as pq

    version, log_path, change, partition_values = entry
    fs, base = _filesystem(root)
    file_fs, location = _data_file_location(fs, base, log_path)
    source = _source_name(version, log_path)
    line = 1
    with file_fs.open_input_file(location) as handle:
        parquet = pq.ParquetFile(handle)
        present = set(parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
            rows = batch.num_rows
            if rows == 0:
                continue
            arrays: list[pa.Array] = []
            for (out, name, is_partition), target_field in zip(layout, target, strict=False):
                assert target_field.name == out
                if is_partition:
                    arrays.append(
                        _partition_array(partition_values.get(name), target_field.type, rows)
                    )
                elif name in present:
                    arrays.append(batch.column(name).cast(target_field.type))
                else:
                    arrays.append(pa.nulls(rows, target_field.type))
            if change == 0:
                arrays.append(_signs(batch.column("_change_type").cast(pa.string()), log_path))
            else:
                arrays.append(pa.repeat(pa.scalar(change, pa.int32()), rows))
            arrays.append(pa.repeat(pa.scalar(version, pa.int64()), rows))
            arrays.append(pa.repeat(pa.scalar(file_idx, pa.int32()), rows))
            arrays.append(pa.repeat(pa.scalar(source, pa.string()), rows))
            arrays.append(pa.array(range(line, line + rows), pa.int64()))
            arrays.append(pa.nulls(rows, pa.string()))
            arrays.append(pa.nulls(rows, pa.string()))
            line += rows
            yield pa.RecordBatch.from_arrays(arrays, schema=target)


class DeltaFilePartition(InputPartition):
    """One data file of a window, read by one Spark task."""

    def __init__(self, index: int, entry: list[Any]) -> None:
        super().__init__(index)
        self.index = index
        self.entry = entry


class _DeltaChangesReader(DataSourceReader):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.root = options["root"]
        self.layout: list[list[Any]] = json.loads(options["layout"])
        self.files: list[list[Any]] = json.loads(options["files"])
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        return [DeltaFilePartition(i, entry) for i, entry in enumerate(self.files)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from pyspark.sql.pandas.types import to_arrow_schema

        assert isinstance(partition, DeltaFilePartition)
        # The exact Arrow schema pyspark checks batches against.
        target = to_arrow_schema(self.schema, timezone="UTC")
        yield from _read_data_file(self.root, partition.index, partition.entry, self.layout, target)


class _DeltaChangesDataSource(DataSource):
    """Spark data source `onceflow_delta_changes`: one partition per data file, signed rows."""

    @classmethod
    def name(cls) -> str:
        return "onceflow_delta_changes"

    def schema(self) -> StructType:
        from pyspark.sql.types import StructType

        return StructType.fromJson(json.loads(self.options["schema"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _DeltaChangesReader(dict(self.options), schema)
