"""A Delta sink's maintenance (`onceflow maintain`): compact, checkpoint, vacuum past the horizon, remove orphans,
clean the log.

Why each step keeps the guarantee (docs/design.md, "Maintenance"):

- Compaction is one commit whose actions all carry `dataChange=false` (small files read and
  written again as one): the rows, the app transactions and the table id stay, and a
  `DeltaTableSource` skips it. Like every onceflow commit it is made on its snapshot with
  `max_commit_retries=0`, so whichever of it and a window's (or restatement's, or repair's)
  commit comes second fails, and decides again on the new snapshot. (delta-rs's OPTIMIZE is
  not used: its post-commit hook cleans the log whatever it is told, past any horizon.)
- A file some readable log entry names but no version from the keep version on holds was
  committed and removed: no commit in flight can name it again (every commit adds new files),
  so it goes without a fence.
- A file no log entry names is either an orphan or the file of a commit still in flight. It
  goes only under the job's fence: a new epoch claimed in the table, after which no older run
  can commit, and only if written before the fence and older than the orphan age.
- Log entries go only below a checkpoint at or before the keep version (a downstream job
  loads the snapshot before its window), older than `delta.logRetentionDuration`, and only
  once their commit records are kept beside the log (`_records`): for a job whose only window
  records are the log, they are what a lost ledger is rebuilt from.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from onceflow.sinks.delta import _records
from onceflow.sinks.delta._files import POST_COMMIT, write_file
from onceflow.sinks.delta._log import LogFacts, data_files, log_files_before, read_log, version_at
from onceflow.sinks.delta.table import COMMIT_TOKEN, META_PREFIX, DeltaTableSink
from onceflow.sinks.maintenance import Hold, Options, TableMaintained
from onceflow.windows import parse_interval

_log = logging.getLogger(__name__)

# Compaction commits lost to concurrent commits before it gives up for this run.
COMPACT_ATTEMPTS = 5
FILE_RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
FILE_RETENTION_DEFAULT = "interval 1 week"
LOG_RETENTION_PROPERTY = "delta.logRetentionDuration"
LOG_RETENTION_DEFAULT = "interval 30 days"
LOG_CLEANUP_PROPERTY = "delta.enableExpiredLogCleanup"


def maintain_table(
    sink: DeltaTableSink,
    holds: Sequence[Hold],
    *,
    log_is_only_record: bool,
    fence: Callable[[], int],
    options: Options,
) -> TableMaintained:
    """Maintain the table of one Delta sink (see the module's docstring for each step's rule).

    Args:
        sink: The sink's table.
        holds: Each downstream job's oldest needed version.
        log_is_only_record: The job's only window records are this log (no PostgreSQL sink):
            an entry goes only if its record is kept beside the log.
        fence: Takes the job's fence (a new epoch claimed in every sink) and returns it.
        options: Dry run, orphan age, compaction target.
    """
    path = sink.path
    table = sink.table()
    version_before = table.version()
    live_before = _live(table)
    files_before = list(data_files(path))
    notes: list[str] = []
    compacted, compaction_version, checkpoint_version = 0, None, None

    small = [size for size in live_before.values() if size < options.target_file_bytes]
    if options.compact and len(small) > 1:
        if options.dry_run:
            compacted = len(small)
        else:
            compacted, compaction_version = _compact(sink, options, notes)
    table = sink.table()
    facts = read_log(path)
    if not options.dry_run and table.version() not in facts.checkpoints:
        table.create_checkpoint()
        checkpoint_version = table.version()
        facts.checkpoints.append(checkpoint_version)
    latest = max(facts.entries, default=table.version())

    config = table.metadata().configuration
    now_ms = int(time.time() * 1000)
    retention = parse_interval(config.get(FILE_RETENTION_PROPERTY, FILE_RETENTION_DEFAULT))
    by_time = version_at(facts, now_ms - int(retention.total_seconds() * 1000))
    if by_time is None:
        by_time = min(facts.entries, default=latest)
    unheld = min(latest, by_time)
    keep = min([unheld, *(h.version for h in holds)])
    binding = tuple(h for h in holds if h.version < unheld)
    for hold in binding:
        _log.warning(
            "sink %s: vacuum keeps files from version %d: job %s %s",
            sink.sink,
            hold.version,
            hold.job,
            hold.reason,
        )

    kept = _kept(sink, facts, keep, notes)
    vacuumed, orphans, fenced = 0, 0, None
    vacuum_bytes = 0
    if kept is not None:
        cutoff_ns = time.time_ns() - int(options.orphan_age.total_seconds() * 1e9)
        gone = [(rel, size) for rel, size, _ in files_before if rel not in kept]
        named = [(rel, size) for rel, size in gone if rel in facts.named]
        candidates = [
            rel
            for rel, _, mtime in files_before
            if rel not in kept and rel not in facts.named and mtime < cutoff_ns
        ]
        vacuumed, vacuum_bytes = len(named), sum(size for _, size in named)
        if options.dry_run:
            orphans = len(candidates)
        else:
            _delete(sink, [rel for rel, _ in named])
            if candidates:
                fenced, orphans = _remove_orphans(sink, kept, candidates, fence, options)

    if not options.dry_run:
        removed = _clean_log(sink, facts, keep, log_is_only_record, config, now_ms, notes)
    else:
        removed = 0
    table = sink.table()
    files_after = list(data_files(path))
    return TableMaintained(
        sink=sink.sink,
        table=str(path),
        version_before=version_before,
        version_after=table.version(),
        files_before=len(files_before),
        bytes_before=sum(size for _, size, _ in files_before),
        files_after=len(files_after),
        bytes_after=sum(size for _, size, _ in files_after),
        live_files_before=len(live_before),
        live_files_after=len(_live(table)),
        compacted_files=compacted,
        compaction_version=compaction_version,
        checkpoint_version=checkpoint_version,
        keep_version=keep,
        log_entries_removed=removed,
        log_records_through=_records.covered_through(sink),
        files_vacuumed=vacuumed,
        bytes_vacuumed=vacuum_bytes,
        orphans_removed=orphans,
        held_by=tuple(holds),
        binding=binding,
        fenced_epoch=fenced,
        notes=tuple(notes),
    )


def _live(table: DeltaTable) -> dict[str, int]:
    from onceflow.sinks.delta._log import relative

    actions = table.get_add_actions(flatten=True)
    out: dict[str, int] = {}
    for path, size in zip(
        actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(), strict=True
    ):
        rel = relative(_location_of(table), path)
        if rel is not None:
            out[rel] = int(size)
    return out


def _location_of(table: DeltaTable):  # noqa: ANN202 - a Location, imported lazily
    from onceflow.storage import Location

    return Location.parse(table.table_uri)


def _compact(sink: DeltaTableSink, options: Options, notes: list[str]) -> tuple[int, int | None]:
    """Rewrite the table's small files into files up to the target size, in one commit whose
    actions all carry `dataChange=false`, made on its snapshot as every onceflow commit is
    (`max_commit_retries=0`): a concurrent commit makes it fail, and it is decided again."""
    for _ in range(COMPACT_ATTEMPTS):
        table = sink.table()
        if table.metadata().partition_columns:
            notes.append("not compacted: the table is partitioned")
            return 0, None
        bins = _bins(pa.table(table.get_add_actions(flatten=True)).to_pylist(), options)
        if not bins:
            return 0, None
        base = table.version()
        folder = f"m{base + 1:010d}-{uuid.uuid4().hex[:8]}"
        actions = _rewrite(sink, folder, bins)
        token = uuid.uuid4().hex
        try:
            table.create_write_transaction(
                actions,
                mode="append",
                schema=table.schema(),
                commit_properties=CommitProperties(
                    custom_metadata={
                        f"{META_PREFIX}job": sink.job,
                        f"{META_PREFIX}sink": sink.sink,
                        f"{META_PREFIX}maintain": "compact",
                        COMMIT_TOKEN: token,
                    },
                    max_commit_retries=0,
                ),
                post_commithook_properties=POST_COMMIT,
            )
        except Exception as exc:
            if sink._landed(token, base) is not None:
                return sum(len(b) for b in bins), base + 1
            (sink.path / folder).delete_tree()
            if not isinstance(exc, CommitFailedError):
                raise
            continue  # the table moved: decide again on the new snapshot
        return sum(len(b) for b in bins), base + 1
    notes.append(
        f"not compacted: the table kept moving ({COMPACT_ATTEMPTS} commits lost); "
        "run `onceflow maintain` again"
    )
    return 0, None


def _bins(adds: list[dict[str, Any]], options: Options) -> list[list[dict[str, Any]]]:
    """The small files in groups of two or more, each group's bytes up to the target."""
    small = [a for a in adds if int(a["size_bytes"]) < options.target_file_bytes]
    bins: list[list[dict[str, Any]]] = [[]]
    size = 0  # of the last bin
    for add in small:
        if bins[-1] and size + int(add["size_bytes"]) > options.target_file_bytes:
            bins.append([])
            size = 0
        bins[-1].append(add)
        size += int(add["size_bytes"])
    return [b for b in bins if len(b) > 1]


def _rewrite(
    sink: DeltaTableSink, folder: str, bins: list[list[dict[str, Any]]]
) -> list[AddAction | RemoveAction]:
    fs = sink.path.filesystem()
    now_ms = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = []
    (sink.path / folder).mkdir()
    for group in bins:
        parts = []
        for add in group:
            with fs.open_input_file((sink.path / unquote(add["path"])).fs_path) as handle:
                parts.append(pq.read_table(handle).replace_schema_metadata(None))
            actions.append(
                RemoveAction(
                    path=add["path"],
                    data_change=False,
                    deletion_timestamp=now_ms,
                    size=int(add["size_bytes"]),
                    partition_values={},
                )
            )
        data = pa.concat_tables(parts, promote_options="default")
        actions.append(write_file(sink.path, folder, data, now_ms, data_change=False))
    return actions


def _kept(sink: DeltaTableSink, facts: LogFacts, keep: int, notes: list[str]) -> set[str] | None:
    """Every file live at version `keep` or later (None: the snapshot at `keep` is gone)."""
    kept: set[str] = set()
    if keep >= 0:
        try:
            snapshot = DeltaTable(sink.path.uri, version=keep, storage_options=sink.options)
        except Exception as exc:
            notes.append(
                f"version {keep} cannot be loaded ({type(exc).__name__}); nothing was vacuumed"
            )
            return None
        kept.update(_live(snapshot))
    for version, adds in facts.adds.items():
        if version > keep:
            kept.update(adds)
    return kept


def _remove_orphans(
    sink: DeltaTableSink,
    kept: set[str],
    candidates: list[str],
    fence: Callable[[], int],
    options: Options,
) -> tuple[int, int]:
    """Remove files no entry names, under the job's fence (see the module's docstring)."""
    fenced_at = time.time_ns()
    epoch = fence()
    # Entries committed since the first read (before the fence) may name candidates.
    facts = read_log(sink.path)
    cutoff_ns = min(fenced_at, time.time_ns() - int(options.orphan_age.total_seconds() * 1e9))
    now = {rel: mtime for rel, _, mtime in data_files(sink.path)}
    orphans = [
        rel
        for rel in candidates
        if rel in now and rel not in facts.named and rel not in kept and now[rel] < cutoff_ns
    ]
    _delete(sink, orphans)
    return epoch, len(orphans)


def _delete(sink: DeltaTableSink, rels: list[str]) -> None:
    if not rels:
        return
    fs = sink.path.filesystem()
    base = sink.path.fs_path.rstrip("/")
    for rel in rels:
        try:
            fs.delete_file(f"{base}/{rel}")
        except FileNotFoundError:
            pass
    if sink.path.is_local:
        for folder in {rel.rsplit("/", 1)[0] for rel in rels if "/" in rel}:
            try:
                (sink.path.path / folder).rmdir()  # only when empty
            except OSError:
                pass


def _clean_log(
    sink: DeltaTableSink,
    facts: LogFacts,
    keep: int,
    log_is_only_record: bool,
    config: dict[str, str],
    now_ms: int,
    notes: list[str],
) -> int:
    if str(config.get(LOG_CLEANUP_PROPERTY, "true")).strip().lower() == "false":
        return 0
    retention = parse_interval(config.get(LOG_RETENTION_PROPERTY, LOG_RETENTION_DEFAULT))
    by_time = version_at(facts, now_ms - int(retention.total_seconds() * 1000))
    if by_time is None:
        return 0
    limit = min(keep, by_time)
    # Every entry that goes has its record kept beside the log first (`_records`).
    kept_through = _records.summarize(sink, limit)
    below = [
        c
        for c in facts.checkpoints
        if c <= limit and (c <= kept_through + 1 or not log_is_only_record)
    ]
    if not below:
        if log_is_only_record and any(c <= limit for c in facts.checkpoints):
            notes.append(
                f"log not cleaned: the records of its entries are kept beside it only through "
                f"version {kept_through} (an entry after it is missing), and the job's only "
                "window records are this log"
            )
        return 0
    files = log_files_before(sink.path, max(below))
    fs = sink.path.filesystem()
    for location in files:
        try:
            fs.delete_file(location.fs_path)
        except FileNotFoundError:
            pass
    return len(files)
