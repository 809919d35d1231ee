"""DeltaTableSource: every change of an upstream Delta table reaches the job exactly once.

Real Delta tables written by delta-rs (appends, restatement-style rewrites, deletes, empty epoch
commits, change data feed), real Spark reads; windows are cut at different version boundaries
and the signed rows of all windows must add up to the table's current content.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, date, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.transaction import AddAction, RemoveAction

from onceflow.errors import SourceError
from onceflow.settings import Settings
from onceflow.sources.delta import DeltaTableSource, version_unit

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("amount", pa.float64()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("day", pa.date32()),
        ("k", pa.string()),
    ]
)
COLUMNS = tuple(SCHEMA.names)


def _settings(lake: Path) -> Settings:
    return Settings(home=lake.parent, postgres_dsn=None, lake=lake, landing=lake.parent / "land")


def _rows(ids: Sequence[int], k: str = "a b") -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": [f"n{i}" for i in ids],
            "amount": [i * 1.5 for i in ids],
            "at": pa.array(
                [datetime(2024, 1, 1, 0, 0, i % 60, tzinfo=UTC) for i in ids],
                pa.timestamp("us", tz="UTC"),
            ),
            "day": pa.array([date(2024, 1, 1 + i % 28) for i in ids], pa.date32()),
            "k": [k] * len(ids),
        },
        schema=SCHEMA,
    )


def _key(row: dict) -> tuple:
    return tuple(_utc(row[c]) for c in COLUMNS)


def _utc(value: object) -> object:
    # Spark's collect gives naive local datetimes, pyarrow aware ones: compare instants.
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    return value


def _read(spark, source: DeltaTableSource, settings: Settings, start: int, end: int) -> list[dict]:
    units = [version_unit(v) for v in range(start, end + 1)]
    offsets = source.offsets(settings, units)
    assert source.check_available(settings, offsets) == []
    return [row.asDict() for row in source.read(spark, settings, offsets).collect()]


def _read_windows(
    spark, source: DeltaTableSource, settings: Settings, cuts: Sequence[int]
) -> list[list[dict]]:
    """Plan windows the way the engine does (discover after the last window) and read them.

    `cuts` are the last versions of the windows; the final window runs to the current version.
    """
    windows: list[list[dict]] = []
    after = None
    for cut in [*cuts, None]:
        units = source.discover(settings, after)
        if cut is not None:
            units = [u for u in units if int(u) <= cut]
        assert units, "every window must have versions"
        offsets = source.offsets(settings, units)
        assert source.units(offsets) == units
        assert source.check_available(settings, offsets) == []
        windows.append([r.asDict() for r in source.read(spark, settings, offsets).collect()])
        after = offsets
    assert source.discover(settings, after) == []
    return windows


def _net(rows: Sequence[dict]) -> Counter:
    """The multiset the signed rows add up to (zero counts dropped)."""
    net: Counter = Counter()
    for row in rows:
        net[_key(row)] += row["_change"]
    return +net


def _current(path: Path) -> Counter:
    table = DeltaTable(str(path)).to_pyarrow_table()
    return Counter(_key(r) for r in table.select(list(COLUMNS)).to_pylist())


def _write_rewrite(path: Path, folder: str, data: pa.Table) -> AddAction:
    """Write `data` (without partition column `k`) as a new file, like a restatement does."""
    name = f"{folder}/part-{uuid.uuid4().hex}.parquet"
    (path / folder).mkdir(parents=True, exist_ok=True)
    pq.write_table(data.drop_columns(["k"]), path / name)
    return AddAction(
        path=name,
        size=(path / name).stat().st_size,
        partition_values={"k": "a"},
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=json.dumps({"numRecords": data.num_rows}),
    )


def _commit(path: Path, actions: list, app: str | None = None, version: int = 1) -> None:
    table = DeltaTable(str(path))
    table.create_write_transaction(
        actions,
        mode="append",
        schema=table.schema(),
        commit_properties=CommitProperties(
            custom_metadata={"onceflow.test": "1"},
            app_transactions=[Transaction(app, version)] if app else None,
        ),
    )


def _hand_commit(path: Path, actions: list[dict]) -> int:
    """Append a commit file written by hand (for features delta-rs does not write)."""
    version = DeltaTable(str(path)).version() + 1
    lines = [{"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "TEST"}}, *actions]
    log = path / "_delta_log" / f"{version:020d}.json"
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return version


# -- 1. appends -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[0, 2], [1], [0, 1, 2, 3]])
def test_appends_arrive_once_whatever_the_window_cuts(spark, lake: Path, cuts: list[int]) -> None:
    path = lake / "payments"
    batches = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11]]
    for version, ids in enumerate(batches):
        # Two partitions per version from version 1 on, one value with a space (URI-encoded
        # in the log, a `%20` folder on disk).
        data = _rows(ids, k="a b") if version % 2 else _rows(ids, k="c")
        write_deltalake(str(path), data, mode="append", partition_by=["k"])
    settings = _settings(lake)
    source = DeltaTableSource("payments")

    windows = _read_windows(spark, source, settings, cuts)
    rows = [row for window in windows for row in window]

    assert all(row["_change"] == 1 for row in rows)
    assert _net(rows) == _current(path)
    by_version = Counter(row["_commit_version"] for row in rows)
    assert by_version == {v: len(ids) for v, ids in enumerate(batches)}
    assert Counter(row["id"] for row in rows) == Counter(i for ids in batches for i in ids)
    # Positions: files indexed within the window, lines 1-based within a file, typed rows.
    for window in windows:
        files = {(row["_file_idx"], row["_source_file"]) for row in window}
        assert sorted(i for i, _ in files) == list(range(len(files)))
        for idx, name in files:
            lines = sorted(r["_source_line"] for r in window if r["_file_idx"] == idx)
            assert lines == list(range(1, len(lines) + 1))
            assert name.startswith("v")
            assert (path / name.split("/", 1)[1]).is_file()
        assert all(r["_reason"] is None and r["_raw_text"] is None for r in window)
    assert {row["k"] for row in rows} == {"a b", "c"}


def test_table_columns_named_like_position_columns_are_kept_as_upstream(spark, lake: Path) -> None:
    path = lake / "enriched"
    upstream = pa.table(
        {
            "payment_id": ["p1", "p2"],
            "_source_file": ["payments/a.jsonl", "payments/b.jsonl"],
            "_source_line": pa.array([7, 9], pa.int64()),
        }
    )
    write_deltalake(str(path), upstream)
    source = DeltaTableSource("enriched", path=str(path))

    rows = _read(spark, source, _settings(lake / "elsewhere"), 0, 0)

    assert sorted(
        (r["payment_id"], r["_upstream_source_file"], r["_upstream_source_line"]) for r in rows
    ) == [("p1", "payments/a.jsonl", 7), ("p2", "payments/b.jsonl", 9)]
    assert {r["_source_file"].split("/", 1)[0] for r in rows} == {"v0"}
    assert sorted(r["_source_line"] for r in rows) == [1, 2]


# -- 2. restatements and deletes ------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[0, 2], [1, 3], []])
def test_restatement_and_delete_net_to_the_current_content(
    spark, lake: Path, cuts: list[int]
) -> None:
    path = lake / "payments"
    write_deltalake(str(path), _rows([1, 2, 3, 4], k="a"), partition_by=["k"])  # v0
    write_deltalake(str(path), _rows([5, 6], k="a"), mode="append")  # v1
    table = DeltaTable(str(path))
    v0_file = next(
        a
        for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()
        if "k=a" in a["path"] and a["num_records"] == 4
    )
    # v2, a restatement: the file holding row 2 is removed, its other rows rewritten, and the
    # restated window's new rows added.
    rewritten = _write_rewrite(path, "r1", _rows([1, 3, 4], k="a"))
    new = _write_rewrite(
        path, "r2", _rows([2, 20], k="a").set_column(1, "name", pa.array(["re2", "n20"]))
    )
    remove = RemoveAction(
        path=v0_file["path"],
        data_change=True,
        deletion_timestamp=int(time.time() * 1000),
        size=v0_file["size_bytes"],
        partition_values={"k": "a"},
    )
    _commit(path, [remove, rewritten, new])
    DeltaTable(str(path)).delete("id = 5")  # v3: rewrites the v1 file without row 5
    DeltaTable(str(path)).optimize.compact()  # v4: dataChange false, not a change
    assert DeltaTable(str(path)).version() == 4
    source = DeltaTableSource("payments")

    rows = [row for window in _read_windows(spark, source, _settings(lake), cuts) for row in window]

    assert _net(rows) == _current(path)
    retracted_at_v2 = {r["id"] for r in rows if r["_change"] == -1 and r["_commit_version"] == 2}
    assert retracted_at_v2 == {1, 2, 3, 4}
    assert [r["name"] for r in rows if r["_change"] == -1 and r["id"] == 2] == ["n2"]
    assert any(r["_change"] == -1 and r["id"] == 5 and r["_commit_version"] == 3 for r in rows)
    assert not [r for r in rows if r["_commit_version"] == 4]
    # Every removed row had been added first: nothing arrives as a retraction out of nowhere.
    _assert_added_before_retracted(rows)


def _assert_added_before_retracted(rows: Sequence[dict]) -> None:
    counts: Counter = Counter()
    for row in sorted(rows, key=lambda r: (r["_commit_version"], -r["_change"])):
        counts[_key(row)] += row["_change"]
        assert counts[_key(row)] >= 0, f"row retracted before it was added: {row}"


# -- 3. empty commits -----------------------------------------------------------------------------


def test_empty_epoch_commits_give_no_rows(spark, lake: Path) -> None:
    path = lake / "payments"
    write_deltalake(str(path), _rows([1, 2]))  # v0
    _commit(path, [], app="payments/lake_payments/epoch", version=1)  # v1
    _commit(path, [], app="payments/lake_payments/epoch", version=2)  # v2
    write_deltalake(str(path), _rows([3]), mode="append")  # v3
    _commit(path, [], app="payments/lake_payments/epoch", version=3)  # v4
    settings = _settings(lake)
    source = DeltaTableSource("payments")

    only_empty = source.read(
        spark, settings, source.offsets(settings, [version_unit(1), version_unit(2)])
    )
    assert only_empty.count() == 0
    assert only_empty.columns[: len(COLUMNS)] == list(COLUMNS)
    assert "_change" in only_empty.columns

    windows = _read_windows(spark, source, settings, [0, 2, 3])
    assert [len(w) for w in windows] == [2, 0, 1, 0]
    assert _net([r for w in windows for r in w]) == _current(path)


# -- 4. what cannot be replayed -------------------------------------------------------------------


def _problem_in(
    source: DeltaTableSource, settings: Settings, spark, start: int, end: int, *needles: str
) -> None:
    offsets = {"table": source.table, "start": start, "end": end}
    problems = source.check_available(settings, offsets)
    assert any(all(n in p for n in needles) for p in problems), problems
    with pytest.raises(SourceError) as raised:
        source.read(spark, settings, offsets)
    assert all(n in str(raised.value) for n in needles), raised.value


def test_vacuumed_files_are_refused(spark, lake: Path) -> None:
    path = lake / "payments"
    write_deltalake(str(path), _rows([1, 2]))  # v0
    write_deltalake(str(path), _rows([3]), mode="overwrite")  # v1 removes v0's file
    write_deltalake(str(path), _rows([4]), mode="append")  # v2
    settings = _settings(lake)
    source = DeltaTableSource("payments")
    assert source.check_available(settings, {"table": "payments", "start": 0, "end": 2}) == []

    DeltaTable(str(path)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)

    _problem_in(source, settings, spark, 1, 1, "version 1", "removed file", "vacuum")
    _problem_in(source, settings, spark, 0, 2, "version 0", "added file", "vacuum")
    assert source.check_available(settings, {"table": "payments", "start": 2, "end": 2}) == []


def test_cleaned_up_commit_file_is_refused(spark, lake: Path) -> None:
    path = lake / "payments"
    for ids in ([1], [2], [3], [4]):
        write_deltalake(str(path), _rows(ids), mode="append")
    DeltaTable(str(path)).create_checkpoint()
    (path / "_delta_log" / f"{1:020d}.json").unlink()
    settings = _settings(lake)
    source = DeltaTableSource("payments")

    _problem_in(source, settings, spark, 1, 2, "version 1", "00000000000000000001.json", "gone")
    assert source.check_available(settings, {"table": "payments", "start": 3, "end": 3}) == []


def test_schema_change_inside_a_window_is_refused(spark, lake: Path) -> None:
    path = lake / "payments"
    write_deltalake(str(path), _rows([1]))  # v0
    write_deltalake(str(path), _rows([2]), mode="append")  # v1
    wider = _rows([3]).append_column("note", pa.array(["x"]))
    write_deltalake(str(path), wider, mode="append", schema_mode="merge")  # v2
    write_deltalake(str(path), wider, mode="append")  # v3
    settings = _settings(lake)
    source = DeltaTableSource("payments")

    _problem_in(source, settings, spark, 1, 2, "version 2", "schema")
    _problem_in(source, settings, spark, 2, 3, "version 2", "schema")
    assert source.check_available(settings, {"table": "payments", "start": 0, "end": 1}) == []
    after = _read(spark, source, settings, 3, 3)
    assert [(r["id"], r["note"]) for r in after] == [(3, "x")]


def test_deletion_vectors_and_column_mapping_are_refused(spark, lake: Path) -> None:
    path = lake / "payments"
    write_deltalake(str(path), _rows([1]))  # v0
    dv = _hand_commit(
        path,
        [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["deletionVectors"],
                    "writerFeatures": ["deletionVectors"],
                }
            }
        ],
    )
    settings = _settings(lake)
    source = DeltaTableSource("payments")
    _problem_in(source, settings, spark, dv, dv, f"version {dv}", "deletion vectors")

    # A deletion vector on an action (the rows it hides would otherwise arrive as added).
    dv_table = lake / "dv_action"
    write_deltalake(str(dv_table), _rows([1, 2]))
    data_file = next(dv_table.glob("*.parquet"))
    dv_on_add = {
        "path": data_file.name,
        "partitionValues": {},
        "size": data_file.stat().st_size,
        "modificationTime": 0,
        "dataChange": True,
        "deletionVector": {
            "storageType": "i",
            "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f55c8Xg0@@D",
            "sizeInBytes": 34,
            "cardinality": 1,
        },
    }
    on_add = _hand_commit(dv_table, [{"add": dv_on_add}])
    dv_source = DeltaTableSource("dv_action")
    _problem_in(
        dv_source, settings, spark, on_add, on_add, f"version {on_add}", "carries a deletion vector"
    )

    other = lake / "mapped"
    write_deltalake(str(other), _rows([1]))
    meta = next(
        json.loads(line)["metaData"]
        for line in (other / "_delta_log" / f"{0:020d}.json").read_text().splitlines()
        if "metaData" in line
    )
    meta["configuration"] = {"delta.columnMapping.mode": "name"}
    cm = _hand_commit(other, [{"metaData": meta}])
    _problem_in(
        DeltaTableSource("mapped"), settings, spark, cm, cm, f"version {cm}", "column mapping"
    )


def test_missing_table_and_foreign_offsets(spark, lake: Path) -> None:
    settings = _settings(lake)
    source = DeltaTableSource("nothing")
    _problem_in(source, settings, spark, 0, 0, "`nothing` is missing")
    write_deltalake(str(lake / "nothing"), _rows([1]))
    _problem_in(source, settings, spark, 0, 3, "version 3", "newest version is 0")
    assert source.check_available(settings, {"table": "other", "start": 0, "end": 0})


# -- 5. change data feed --------------------------------------------------------------------------


def test_change_data_files_replace_add_and_remove(spark, lake: Path) -> None:
    path = lake / "payments"
    write_deltalake(
        str(path), _rows([1, 2, 3, 4]), configuration={"delta.enableChangeDataFeed": "true"}
    )  # v0
    write_deltalake(str(path), _rows([5]), mode="append")  # v1: no cdc, add actions count
    DeltaTable(str(path)).delete("id = 2")  # v2
    DeltaTable(str(path)).update(updates={"name": "'renamed'"}, predicate="id = 3")  # v3
    log = [
        json.loads(line)
        for line in (path / "_delta_log" / f"{2:020d}.json").read_text().splitlines()
    ]
    assert any("cdc" in a for a in log), "delta-rs wrote no change data file for DELETE"
    source = DeltaTableSource("payments")

    windows = _read_windows(spark, source, _settings(lake), [1, 2])
    rows = [r for w in windows for r in w]

    assert [(r["id"], r["_change"]) for r in windows[1]] == [(2, -1)]
    assert sorted((r["id"], r["name"], r["_change"]) for r in windows[2]) == [
        (3, "n3", -1),
        (3, "renamed", 1),
    ]
    assert all(
        r["_source_file"].startswith(("v2/_change_data/", "v3/_change_data/"))
        for r in rows
        if r["_commit_version"] >= 2
    )
    assert _net(rows) == _current(path)


# -- 6. planning ----------------------------------------------------------------------------------


def test_discover_offsets_units_round_trip(lake: Path) -> None:
    settings = _settings(lake)
    source = DeltaTableSource("payments")
    assert source.kind == "delta" and source.typed
    assert source.describe() == "Delta table `payments` (by version)"
    assert source.discover(settings, None) == []
    empty = source.observe(settings)
    assert (empty.version, empty.units, empty.metadata["table_version"]) == ("-1", 0, -1)

    path = lake / "payments"
    for ids in ([1], [2], [3]):
        write_deltalake(str(path), _rows(ids), mode="append")
    units = source.discover(settings, None)
    assert units == ["00000000000000000000", "00000000000000000001", "00000000000000000002"]
    assert sorted(units) == units
    assert source.discover(settings, {}) == units
    assert source.discover(settings, {"table": "payments", "start": 0, "end": 1}) == units[2:]
    assert source.discover(settings, {"table": "payments", "start": 0, "end": 2}) == []

    offsets = source.offsets(settings, units[1:])
    table_id = DeltaTable(str(path)).metadata().id
    tokens = [_token(path, v) for v in range(3)]
    assert offsets == {
        "table": "payments",
        "start": 1,
        "end": 2,
        "table_id": table_id,
        "commits": tokens[1:],
    }
    assert json.loads(json.dumps(offsets)) == offsets
    assert source.units(offsets) == units[1:]
    assert source.offsets(settings, list(reversed(units))) == {
        "table": "payments",
        "start": 0,
        "end": 2,
        "table_id": table_id,
        "commits": tokens,
    }
    assert source.rebased(settings, offsets) is None  # the same table, the same commits
    with pytest.raises(SourceError, match="contiguous"):
        source.offsets(settings, [units[0], units[2]])
    with pytest.raises(SourceError, match="contiguous"):
        source.offsets(settings, [units[0], units[0]])
    with pytest.raises(SourceError, match="20 digits"):
        source.offsets(settings, ["1"])
    with pytest.raises(SourceError, match="at least one"):
        source.offsets(settings, [])

    seen = source.observe(settings)
    assert (seen.version, seen.units, seen.metadata["table_version"]) == ("2", 3, 2)
    age = source.unit_age_s(settings, units[2])
    assert age is not None and 0 <= age < 600
    log = (path / "_delta_log" / f"{2:020d}.json").read_text().splitlines()
    sizes = [json.loads(line)["add"]["size"] for line in log if '"add"' in line]
    assert sizes and source.unit_size(settings, units[2]) == sum(sizes)


# -- 7. the table's identity ----------------------------------------------------------------------


def _token(path: Path, version: int) -> str:
    from onceflow.sources.delta import commit_token

    return commit_token((path / "_delta_log" / f"{version:020d}.json").read_bytes())


def _plan_all(source: DeltaTableSource, settings: Settings, cuts: Sequence[int]) -> list[dict]:
    """Offsets of windows planned the way the engine does, each ending at a cut."""
    windows: list[dict] = []
    after = None
    for cut in cuts:
        units = [u for u in source.discover(settings, after) if int(u) <= cut]
        after = source.offsets(settings, units)
        windows.append(after)
    return windows


def test_a_recreated_table_is_refused_never_skipped_or_read_again(spark, lake: Path) -> None:
    path = lake / "payments"
    for ids in ([1, 2], [3], [4], [5]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v0..v3
    settings = _settings(lake)
    source = DeltaTableSource("payments")
    first, second = _plan_all(source, settings, [1, 3])
    assert source.discover(settings, second) == []

    # Deleted and created again with other rows, in fewer versions than were read: reading on
    # after version 3 would skip the new table's versions 0-3 for good.
    shutil.rmtree(path)
    for ids in ([10], [11]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v0..v1
    with pytest.raises(SourceError, match=r"version 3 is not in the table any more") as raised:
        source.discover(settings, second)
    assert "`onceflow restate <job> --source-replaced`" in str(raised.value)
    with pytest.raises(SourceError, match="cannot be read again"):
        source.rebased(settings, second)

    # Refilled past the versions read: planning on would read versions 4.. only, and a replay
    # of a window read the new table's versions 0-1 as if they were the old ones.
    for ids in ([12], [13], [14]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v2..v4
    with pytest.raises(SourceError, match=r"version 3 is of another table than the one read"):
        source.discover(settings, second)
    _problem_in_offsets(source, settings, spark, first, "version 1 is of another table")
    _problem_in_offsets(source, settings, spark, first, "version 0 is another commit")

    # The recovery: the windows re-pointed at the table as it is now read its versions.
    rebased = source.rebased(settings, first)
    assert rebased is not None and rebased["table_id"] == DeltaTable(str(path)).metadata().id
    assert rebased["commits"] == [_token(path, 0), _token(path, 1)]
    assert source.check_available(settings, rebased) == []
    rows = source.read(spark, settings, rebased).collect()
    assert sorted(r["id"] for r in rows) == [10, 11]
    second = source.rebased(settings, second)
    assert source.discover(settings, second) == [version_unit(4)]


def test_a_table_restored_from_an_older_copy_and_extended_is_refused(
    spark, lake: Path, tmp_path: Path
) -> None:
    path = lake / "payments"
    for ids in ([1, 2], [3]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v0..v1
    copy = tmp_path / "backup"
    shutil.copytree(path, copy)
    for ids in ([4], [5]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v2..v3
    settings = _settings(lake)
    source = DeltaTableSource("payments")
    first, second = _plan_all(source, settings, [1, 3])
    old = {"table": "payments", "start": 2, "end": 3}  # as planned before identities

    # Restored from the copy (the same table id) and written to again: versions 2-4 are new.
    shutil.rmtree(path)
    shutil.copytree(copy, path)
    for ids in ([6], [7], [8]):
        write_deltalake(str(path), _rows(ids), mode="append")  # v2..v4
    with pytest.raises(SourceError, match="version 3 is another commit than the one read"):
        source.discover(settings, second)
    _problem_in_offsets(source, settings, spark, second, "version 2 is another commit")
    # The versions both tables share are the same commits: that window is still good.
    assert source.check_available(settings, first) == []
    assert source.rebased(settings, first) is None
    # Offsets planned before identities were recorded keep working (by version, as before),
    # and the recovery re-points them too, since nothing says what they read.
    assert source.check_available(settings, old) == []
    assert source.rebased(settings, old) == {**old, **source.rebased(settings, second)}


def _problem_in_offsets(
    source: DeltaTableSource, settings: Settings, spark, offsets: dict, *needles: str
) -> None:
    problems = source.check_available(settings, offsets)
    assert any(all(n in p for n in needles) for p in problems), problems
    with pytest.raises(SourceError) as raised:
        source.read(spark, settings, offsets)
    assert all(n in str(raised.value) for n in needles), raised.value
    assert "--source-replaced" in str(raised.value)


def test_path_outside_the_lake(lake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "other" / "t"
    write_deltalake(str(elsewhere), _rows([1]))
    monkeypatch.chdir(tmp_path)
    # A relative path is made absolute on the driver: executors may run elsewhere.
    assert DeltaTableSource("t", path="other/t").root(_settings(lake)) == str(elsewhere)
    units = DeltaTableSource("t", path=str(elsewhere)).discover(_settings(lake), None)
    assert units == [version_unit(0)]
    assert DeltaTableSource("t").discover(_settings(lake), None) == []
