"""The Delta commit protocol: one Delta commit per window, checked and made atomically.

delta-rs records application transactions but never checks them on commit, so two writers can
both commit the same window. Here the check (is the window's `txn` version already at or past
this window? has a newer epoch fenced this run?) is made on a loaded snapshot, and the commit is
made against that same snapshot with `max_commit_retries=0`: if anyone committed in between,
ours fails with CommitFailedError; we reload, and if the table moved (a real conflict) check
again, a bounded number of times with backoff. A CommitFailedError without a newer version is
not a conflict (delta-rs raises it for unsupported features too) and fails the commit.

Executors write the Parquet data files straight into the table folder, through pyarrow's
filesystem (local or S3), and report each file's size and rows; the driver commits those add
actions and never lists the folder. On S3 the log entry is a conditional put. A failed commit
is decided by reading, by name, the entry it tried to write: one carrying its token means it
landed (its answer was lost, or delta-rs failed after writing it), and its files are kept.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction

from onceflow._identifiers import delta_app_id, epoch_app_id, restate_app_id
from onceflow.errors import FencedError, SinkError, SinkStateError, TransientSinkError
from onceflow.sinks.delta._files import POST_COMMIT, add_actions, rewrite_without_window
from onceflow.sinks.writers import ParquetFileWriter, run_writers, spark_schema_to_arrow
from onceflow.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.sink_state import Expected

_log = logging.getLogger(__name__)

META_PREFIX = "onceflow."
# A commit's own id in its metadata, to recognise it after its answer was lost.
COMMIT_TOKEN = f"{META_PREFIX}commit"
# Attempts at a commit that keeps losing real conflicts, and the longest pause between two.
COMMIT_ATTEMPTS = 12
MAX_BACKOFF_S = 2.0
# How long a table known to exist (its first log entry read by name) may stay hidden by a
# listing that lags (an eventually consistent object store) before loading it fails.
LISTING_LAG_S = 15.0

T = TypeVar("T")


@dataclass(frozen=True)
class DeltaCommit:
    """What a window's Delta commit did."""

    version: int | None  # the table version holding the window; None if it was already there
    rows: int
    already_committed: bool


class DeltaTableSink:
    """The Delta side of one sink of one job: its table, app transactions and epoch claims."""

    def __init__(self, job: str, sink: str, path: Location | str) -> None:
        self.job = job
        self.sink = sink
        self.path = path if isinstance(path, Location) else Location.parse(str(path))
        self.options = self.path.delta_options()
        self.app_id = delta_app_id(job, sink)
        self.epoch_app = epoch_app_id(job, sink)
        self.restate_app = restate_app_id(job, sink)
        self._pinned: DeltaTable | None = None  # see `pinned`

    # -- table --------------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the table exists, decided by reading its log's first entry or its last
        checkpoint by name (a listing on an object store may not show a new table yet)."""
        log = self.path / "_delta_log"
        return self._entry(0) is not None or (log / "_last_checkpoint").is_file()

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Read-only checks in a row share one snapshot: each load lists the whole log."""
        if self._pinned is not None:  # within an outer pin: its snapshot
            yield
            return
        self._pinned = self.table() if self.exists() else None
        try:
            yield
        finally:
            self._pinned = None

    def table(self) -> DeltaTable:
        if self._pinned is not None:
            return self._pinned
        deadline = time.monotonic() + LISTING_LAG_S
        delay = 0.1
        while True:
            try:
                table = DeltaTable(self.path.uri, storage_options=self.options)
            except TableNotFoundError:
                # Loading lists the log; a table whose entries can be read by name is there,
                # and the listing will show it.
                if time.monotonic() < deadline and self.exists():
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise SinkStateError(
                    f"sink {self.sink}: Delta table {self.path} is missing. "
                    f"{self._reconcile_hint()}"
                ) from None
            # An object store's listing may lag and leave out the newest entries: a snapshot
            # older than the log read by name would pass for a table that lacks windows. A
            # local folder's listing does not lag.
            if self.path.is_local:
                return table
            newer = table.version() + 1
            if self._entry(newer) is None:
                return table
            if time.monotonic() >= deadline:
                raise TransientSinkError(
                    f"sink {self.sink}: the store's listing of {self.path} has not shown log "
                    f"entry {newer} for {LISTING_LAG_S:g}s though it can be read; nothing was "
                    "written. Run again."
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _reconcile_hint(self) -> str:
        return (
            f"Run `onceflow reconcile {self.job}`: it puts back every window the table lacks "
            "(through the commit protocol), then run the job again."
        )

    @staticmethod
    def identity(table: DeltaTable) -> str:
        """The table's id, set when it was created and kept by every commit; a table deleted
        and created again at the same path has another one."""
        return str(table.metadata().id)

    def ensure_table(self, schema: pa.Schema, expected: Expected | None = None) -> str | None:
        """Create the table if it is missing and nothing says it existed; return its identity.

        With `expected` (an exactly-once job), a missing table is created only when the sink
        must hold no window yet and the ledger recorded no table for it; an existing table must
        be the one recorded. Never creates a table in the middle of a job's life.

        Raises:
            SinkStateError: The table is missing though the sink holds windows, or is not the
                table the ledger recorded.
        """
        if self.exists():
            identity = self.identity(self.table())
            if expected is not None and expected.identity not in (None, identity):
                raise self._replaced(expected.identity, identity)
            return identity
        if expected is not None and (expected.identity is not None or expected.through):
            raise SinkStateError(
                f"sink {self.sink}: Delta table {self.path} is missing, but the ledger records "
                f"that it holds windows through {expected.through} (was the lake deleted or "
                f"moved?). Nothing was written. {self._reconcile_hint()}"
            )
        self.path.mkdir()
        try:
            DeltaTable.create(
                self.path.uri, schema, mode="error", name=self.sink, storage_options=self.options
            )
        except Exception as exc:
            # Created by a concurrent writer, or by this call with its answer lost: decided by
            # reading the first log entry by name, not from a listing.
            if not self.exists():
                raise SinkError(
                    f"sink {self.sink}: cannot create Delta table {self.path} "
                    f"({type(exc).__name__})"
                ) from None
        return self.identity(self.table())

    def _replaced(self, recorded: str, found: str) -> SinkStateError:
        return SinkStateError(
            f"sink {self.sink}: Delta table {self.path} is not the table onceflow wrote (its id "
            f"is {found}, the ledger recorded {recorded}): it was deleted and created again, or "
            f"another table was put in its place. Nothing was written. {self._reconcile_hint()}"
        )

    def check_holds(self, table: DeltaTable, expected: Expected, window_id: int) -> bool:
        """On the snapshot `table` a commit of `window_id` is made against: True if the table
        holds the window already; raise unless it is exactly the state the ledger expects.

        Raises:
            SinkStateError: Another table, a table that lacks windows or restatements the ledger
                says it committed, or one that holds windows the ledger never completed.
        """
        found = self.identity(table)
        if expected.identity is not None and found != expected.identity:
            raise self._replaced(expected.identity, found)
        through = table.transaction_version(self.app_id) or 0
        if through >= window_id:
            return True
        if through != expected.through:
            raise SinkStateError(
                f"sink {self.sink}: Delta table {self.path} holds windows through {through}, "
                f"but the ledger records that it committed windows through {expected.through} "
                "(was it restored from an older copy, or written outside onceflow?). Nothing "
                f"was written. {self._reconcile_hint()}"
            )
        restated = table.transaction_version(self.restate_app) or 0
        if expected.through and restated < expected.restated:
            raise SinkStateError(
                f"sink {self.sink}: Delta table {self.path} has applied restatements through "
                f"{restated}, but the ledger completed restatements through {expected.restated} "
                "(was it restored from an older copy?). Nothing was written. "
                f"{self._reconcile_hint()}"
            )
        return False

    def committed_through(self) -> int:
        """The highest window id this sink holds (0 if none)."""
        if not self.exists():
            return 0
        return self.table().transaction_version(self.app_id) or 0

    def fenced_by(self) -> int:
        """The highest epoch that has claimed this table (0 if none)."""
        if not self.exists():
            return 0
        return self.table().transaction_version(self.epoch_app) or 0

    # -- commits ------------------------------------------------------------------------------

    def _commit(
        self,
        attempt: Callable[[DeltaTable], T | None],
        actions: Callable[[DeltaTable], list[Any]],
        properties: Callable[[DeltaTable], CommitProperties],
        *,
        on_conflict: Callable[[], None] | None = None,
        retry_on_conflict: bool = True,
    ) -> T | int:
        """Check on a snapshot, commit on that snapshot, and decide again after a conflict.

        `attempt(table)` returns a result to stop without committing (already there), or None
        to commit `actions(table)` with `properties(table)`. Returns the stop result, or the
        version committed. The table is not loaded again after a commit: on an object store a
        listing may not show the new entry yet, and a commit made on version `v` is `v + 1`.
        """
        delay = 0.05
        for n in range(COMMIT_ATTEMPTS):
            table = self.table()
            stop = attempt(table)
            if stop is not None:
                return stop
            token = uuid.uuid4().hex
            props = properties(table)
            props.custom_metadata = {**(props.custom_metadata or {}), COMMIT_TOKEN: token}
            base = table.version()
            try:
                table.create_write_transaction(
                    actions(table),
                    mode="append",
                    schema=table.schema(),
                    commit_properties=props,
                    post_commithook_properties=POST_COMMIT,
                )
            except Exception as exc:
                # The commit may have landed though the call failed (its answer lost: a retried
                # conditional put meets its own entry; an error after the entry was written).
                # Its files are the table's now: it counts as done and nothing is removed.
                landed = self._landed(token, base)
                if landed is not None:
                    _log.warning(
                        "sink %s: the commit failed (%s) after its log entry was written; it "
                        "landed as version %d",
                        self.sink,
                        type(exc).__name__,
                        landed,
                    )
                    return landed
                if not isinstance(exc, CommitFailedError):
                    raise
                # The entry we raced for is there and not ours (read directly: a listing may
                # not show it yet): a real conflict, so our files are unused.
                moved = self._entry(base + 1) is not None
                if on_conflict and moved:
                    on_conflict()
                if not moved:
                    raise SinkError(
                        f"sink {self.sink}: Delta refused the commit without a conflicting "
                        f"writer ({type(exc).__name__}); nothing was written. Check the table's "
                        "protocol and features."
                    ) from None
                if not retry_on_conflict:
                    raise TransientSinkError(
                        f"sink {self.sink}: the Delta table changed during the commit; nothing "
                        "was written. Run again."
                    ) from None
                _log.info("sink %s: commit conflict (attempt %d); deciding again", self.sink, n)
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            return base + 1
        raise TransientSinkError(
            f"sink {self.sink}: lost {COMMIT_ATTEMPTS} commit races in a row on {self.path}; "
            "another writer keeps committing. Run again."
        )

    def _landed(self, token: str, base: int) -> int | None:
        """`base + 1` if the commit made on version `base` landed: that log entry carries its
        `token`. The entry is read by name, not found by listing, which on an object store may
        not show a new entry yet; a commit made on `base` can only be `base + 1`."""
        info = self._entry(base + 1)
        return base + 1 if info is not None and info.get(COMMIT_TOKEN) == token else None

    def _entry(self, version: int) -> dict[str, Any] | None:
        """The commit info of log entry `version`, None if there is no such entry."""
        actions = self.entry_actions(version)
        if actions is None:
            return None
        for action in actions:
            if "commitInfo" in action:
                return dict(action["commitInfo"])
        return {}

    def entry_actions(self, version: int) -> list[dict[str, Any]] | None:
        """The actions of log entry `version`, read by name; None if there is no such entry."""
        entry = self.path / "_delta_log" / f"{version:020d}.json"
        try:
            lines = entry.read_bytes().splitlines()
        except FileNotFoundError:
            return None
        except OSError:
            if entry.is_file():
                raise
            return None
        return [json.loads(line) for line in lines if line.strip()]

    def claim_epoch(self, epoch: int) -> None:
        """Record `epoch` in the table, so any commit of an older run fails from now on."""
        if not self.exists():
            return

        def attempt(table: DeltaTable) -> bool | None:
            current = table.transaction_version(self.epoch_app) or 0
            if current > epoch:
                raise self._fenced(epoch, current)
            return True if current == epoch else None

        self._commit(
            attempt,
            lambda table: [],
            lambda table: CommitProperties(
                custom_metadata={
                    f"{META_PREFIX}epoch": str(epoch),
                    f"{META_PREFIX}job": self.job,
                    f"{META_PREFIX}sink": self.sink,
                },
                max_commit_retries=0,
                app_transactions=[Transaction(self.epoch_app, epoch)],
            ),
        )

    def record_restated(self, seq: int, epoch: int) -> None:
        """Record restatements through `seq` as applied (after reconcile made the rows so)."""
        if seq == 0 or not self.exists():
            return

        def attempt(table: DeltaTable) -> bool | None:
            self._check(table, 0, epoch)
            return True if (table.transaction_version(self.restate_app) or 0) >= seq else None

        self._commit(
            attempt,
            lambda table: [],
            lambda table: CommitProperties(
                custom_metadata={
                    f"{META_PREFIX}job": self.job,
                    f"{META_PREFIX}sink": self.sink,
                    f"{META_PREFIX}epoch": str(epoch),
                },
                max_commit_retries=0,
                app_transactions=[Transaction(self.restate_app, seq)],
            ),
        )

    def file_writer(
        self, key: str, output: str, schema: pa.Schema, window_id: int, epoch: int
    ) -> ParquetFileWriter:
        """A writer the executors use to write one window's Parquet files into the table."""
        folder = f"w{window_id:010d}-e{epoch}-{uuid.uuid4().hex[:8]}"
        return ParquetFileWriter(key, output, self.path, folder, schema)

    def write_files(self, df: DataFrame, window_id: int, epoch: int) -> list[AddAction]:
        """Have the executors write `df` as Parquet into the table folder; return add actions."""
        writer = self.file_writer("files", "df", spark_schema_to_arrow(df), window_id, epoch)
        return add_actions(run_writers({"df": df}, [writer]).written[writer.key])

    def commit_files(
        self,
        adds: list[AddAction],
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        offsets: dict[str, Any],
        exactly_once: bool = True,
        expected: Expected | None = None,
    ) -> DeltaCommit:
        """Commit the window's files (`adds`) in one Delta commit, unless the table holds it.

        With `expected` (what the ledger says the table holds), the commit is made only on a
        snapshot that is exactly that state (`check_holds`). A table's first window also
        records the job's restatements as applied: no window it holds was restated before.
        """
        rows = sum(json.loads(a.stats)["numRecords"] for a in adds)
        metadata = {
            f"{META_PREFIX}job": self.job,
            f"{META_PREFIX}sink": self.sink,
            f"{META_PREFIX}window_id": str(window_id),
            f"{META_PREFIX}epoch": str(epoch),
            f"{META_PREFIX}run_id": run_id,
            f"{META_PREFIX}offsets": json.dumps(offsets),
            f"{META_PREFIX}rows": str(rows),
        }

        def attempt(table: DeltaTable) -> DeltaCommit | None:
            if exactly_once:
                if expected is not None:
                    held = self.check_holds(table, expected, window_id)
                else:
                    held = (table.transaction_version(self.app_id) or 0) >= window_id
                if held:
                    self._discard(adds)
                    return DeltaCommit(None, 0, True)
                self._check(table, window_id, epoch)
            return None

        def transactions(table: DeltaTable) -> list[Transaction]:
            txns = [
                Transaction(self.app_id, window_id),
                # The first commit of a run claims the table for its epoch too.
                Transaction(self.epoch_app, epoch),
            ]
            if (
                expected is not None
                and expected.through == 0
                and expected.restated > (table.transaction_version(self.restate_app) or 0)
            ):
                txns.append(Transaction(self.restate_app, expected.restated))
            return txns

        done = self._commit(
            attempt,
            lambda table: list(adds),
            lambda table: CommitProperties(
                custom_metadata=metadata,
                max_commit_retries=0,
                app_transactions=transactions(table),
            ),
        )
        if isinstance(done, DeltaCommit):
            return done
        return DeltaCommit(done, rows, False)

    def replace_window(
        self,
        df: DataFrame,
        *,
        window_id: int,
        epoch: int,
        run_id: str,
        restate_seq: int,
    ) -> DeltaCommit:
        """Replace every row of `window_id` by `df` in one commit (a restatement)."""
        adds = self.write_files(df, window_id, epoch)
        rows = sum(json.loads(a.stats)["numRecords"] for a in adds)
        rewritten: list[AddAction] = []

        def attempt(table: DeltaTable) -> DeltaCommit | None:
            self._check(table, window_id, epoch, require_committed=True)
            if (table.transaction_version(self.restate_app) or 0) >= restate_seq:
                self._discard(adds)
                return DeltaCommit(None, 0, True)
            return None

        def actions(table: DeltaTable) -> list[Any]:
            removes, kept = rewrite_without_window(self.path, table, window_id, epoch)
            rewritten[:] = kept
            return [*removes, *kept, *adds]

        done = self._commit(
            attempt,
            actions,
            lambda table: CommitProperties(
                custom_metadata={
                    f"{META_PREFIX}job": self.job,
                    f"{META_PREFIX}sink": self.sink,
                    f"{META_PREFIX}restated_window_id": str(window_id),
                    f"{META_PREFIX}epoch": str(epoch),
                    f"{META_PREFIX}run_id": run_id,
                    f"{META_PREFIX}rows": str(rows),
                },
                max_commit_retries=0,
                app_transactions=[Transaction(self.restate_app, restate_seq)],
            ),
            on_conflict=lambda: self._discard(rewritten),
        )
        if isinstance(done, DeltaCommit):
            return done
        return DeltaCommit(done, rows, False)

    def commit_repair(
        self,
        table: DeltaTable,
        removes: list[RemoveAction],
        adds: list[AddAction],
        *,
        epoch: int,
        run_id: str,
        counts: dict[str, int],
    ) -> int:
        """Commit a reconcile repair against the snapshot `table` the diff read; once only.

        Raises:
            TransientSinkError: The table changed since that snapshot; nothing changed.
        """
        self._check(table, 0, epoch)
        token = uuid.uuid4().hex
        base = table.version()
        try:
            table.create_write_transaction(
                [*removes, *adds],
                mode="append",
                schema=table.schema(),
                commit_properties=CommitProperties(
                    custom_metadata={
                        f"{META_PREFIX}job": self.job,
                        f"{META_PREFIX}sink": self.sink,
                        f"{META_PREFIX}reconciled": json.dumps(counts),
                        f"{META_PREFIX}epoch": str(epoch),
                        f"{META_PREFIX}run_id": run_id,
                        COMMIT_TOKEN: token,
                    },
                    max_commit_retries=0,
                    app_transactions=[Transaction(self.epoch_app, epoch)],
                ),
                post_commithook_properties=POST_COMMIT,
            )
        except Exception as exc:
            landed = self._landed(token, base)
            if landed is not None:  # it landed though the call failed
                return landed
            if not isinstance(exc, CommitFailedError):
                raise
            self._discard(adds)
            raise TransientSinkError(
                f"sink {self.sink}: the Delta table changed while it was being reconciled; "
                "nothing was changed. Run reconcile again."
            ) from None
        return base + 1

    def _check(
        self, table: DeltaTable, window_id: int, epoch: int, require_committed: bool = False
    ) -> None:
        claimed = table.transaction_version(self.epoch_app) or 0
        if claimed > epoch:
            raise self._fenced(epoch, claimed)
        if require_committed and (table.transaction_version(self.app_id) or 0) < window_id:
            raise SinkError(f"sink {self.sink}: window {window_id} is not committed; run it first.")

    def _fenced(self, epoch: int, claimed: int) -> FencedError:
        return FencedError(
            f"job {self.job!r}: this run (epoch {epoch}) was fenced by a newer run (epoch "
            f"{claimed}) on Delta table {self.sink}; it stopped without writing."
        )

    def _discard(self, actions: list[AddAction]) -> None:
        folders = {a.path.split("/", 1)[0] for a in actions if "/" in a.path}
        for folder in folders:
            try:
                (self.path / folder).delete_tree()
            except OSError:  # an orphan folder is harmless: no log entry names its files
                _log.warning("sink %s: could not remove unused files in %s", self.sink, folder)

    # -- reading ------------------------------------------------------------------------------

    def first_entry(self) -> dict[str, Any] | None:
        """The commit info of log entry 0 (the table's creation), None when it is gone.

        Log cleanup removes the oldest entries first (below a checkpoint, past the horizon), so
        version 0 present means the log names every commit. Read by name, not from a listing."""
        return self._entry(0)
