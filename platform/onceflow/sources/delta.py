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

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onceflow.errors import SourceError
from onceflow.sources._delta_changes import (
    EXTRA_COLUMNS,
    UPSTREAM_PREFIX,
    _DeltaChangesDataSource,
    _frame_schema,
)
from onceflow.sources._delta_log import (
    COMMITS,
    RESTATE_FIX,
    TABLE_ID,
    _actions,
    _check_files_exist,
    _commit_mtime,
    _DataFile,
    _feature_problems,
    _filesystem,
    _hive_partition_values,
    _id_problems,
    _is_uri,
    _latest_version,
    _parse_unit,
    _Plan,
    _read_commit,
    _read_entry,
    _renumbered,
    _schema_before,
    _snapshot,
    _table_id,
    _token_problems,
    commit_token,
    version_unit,
)
from onceflow.sources.base import Observation, Source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.settings import Settings

__all__ = [
    "COMMITS",
    "EXTRA_COLUMNS",
    "RESTATE_FIX",
    "TABLE_ID",
    "UPSTREAM_PREFIX",
    "DeltaTableSource",
    "commit_token",
    "version_unit",
]


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

        _check_files_exist(plan, fs, base)
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
