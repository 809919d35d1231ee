"""LandingSource: every line of every planned file once, at its position, whatever the files'
names and sizes and however the read is split: the two line splitters (a file read whole, a file
read line by line) called directly, and Spark's read split one way or another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from onceflow.errors import SourceError
from onceflow.settings import Settings
from onceflow.sources import landing as landing_module
from onceflow.sources.landing import LandingSource

SOURCE = LandingSource(folder="in", suffix=".jsonl")
# Names Hadoop paths glob or misparse, and plain ones.
NAMES = ["a plain.jsonl", "b:colon.jsonl", "c#hash%25.jsonl", "d[glob]*{x}.jsonl", "e\\slash.jsonl"]


@pytest.fixture()
def settings(tmp_path: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path, postgres_dsn=None, lake=tmp_path / "lake", landing=landing)


def put_files(settings: Settings) -> dict[str, list[bytes]]:
    """Files of a few lines each (one empty, one without a final newline, one with a blank and
    an invalid-UTF-8 line); returns each file's lines as the source must give them."""
    folder = settings.landing.path / SOURCE.folder
    folder.mkdir(parents=True, exist_ok=True)
    contents = {
        NAMES[0]: b'{"n": 1}\n{"n": 2}\n',
        NAMES[1]: b"",
        NAMES[2]: b'{"n": 3}\n\n\xff\xfe not utf-8\n',
        NAMES[3]: b'{"n": 4}\n{"n": 5}',
        NAMES[4]: b"".join(b'{"n": %d}\n' % i for i in range(6, 500)),
    }
    for name, content in contents.items():
        (folder / name).write_bytes(content)
    return {
        f"{SOURCE.folder}/{name}": content.split(b"\n")[:-1]
        if content.endswith(b"\n")
        else content.split(b"\n")
        if content
        else []
        for name, content in contents.items()
    }


def read_rows(spark, settings: Settings) -> tuple[list[tuple[Any, ...]], int]:
    offsets = SOURCE.offsets(settings, SOURCE.discover(settings, None))
    frame = SOURCE.read(spark, settings, offsets)
    rows = [
        (r["_file_idx"], r["_source_file"], r["_source_line"], bytes(r["_raw"]))
        for r in frame.collect()
    ]
    return rows, frame.rdd.getNumPartitions()


def expected_rows(lines: dict[str, list[bytes]]) -> list[tuple[Any, ...]]:
    return [
        (idx, rel, number, raw)
        for idx, rel in enumerate(sorted(lines))
        for number, raw in enumerate(lines[rel], start=1)
    ]


def test_every_line_of_every_file_once_at_its_position_whatever_the_names(
    spark, settings: Settings
) -> None:
    lines = put_files(settings)
    rows, partitions = read_rows(spark, settings)
    # In file order, then line order: the one task of a small window reads them so.
    assert rows == expected_rows(lines)
    assert partitions == 1
    offsets = SOURCE.offsets(settings, SOURCE.discover(settings, None))
    assert SOURCE.reads_in_order(spark, settings, offsets)


@pytest.mark.parametrize(
    ("limit", "tasks"),
    [
        ("ONE_TASK_MAX_BYTES", 2),  # a large window: read whole, a run of files a core
        ("WHOLE_READ_MAX_BYTES", len(NAMES)),  # large files: read line by line, a file a task
    ],
)
def test_a_window_read_by_several_tasks_gives_each_task_its_lines_in_order(
    spark, settings: Settings, monkeypatch: pytest.MonkeyPatch, limit: str, tasks: int
) -> None:
    lines = put_files(settings)
    monkeypatch.setattr(landing_module, limit, 100)
    monkeypatch.setattr(landing_module, "_read_cores", lambda spark: 2)
    rows, partitions = read_rows(spark, settings)
    assert sorted(rows) == expected_rows(lines)
    assert partitions == tasks
    offsets = SOURCE.offsets(settings, SOURCE.discover(settings, None))
    assert not SOURCE.reads_in_order(spark, settings, offsets)
    # What the key lookup relies on to mark repeats as the rows pass: each task's rows come in
    # source order.
    assert SOURCE.reads_in_runs(spark, settings, offsets)
    frame = SOURCE.read(spark, settings, offsets)
    shares = frame.rdd.glom().map(lambda rs: [(r._file_idx, r._source_line) for r in rs]).collect()
    assert len(shares) == tasks
    assert all(share == sorted(share) for share in shares)
    assert sum(1 for share in shares if share) > 1


def test_a_large_window_is_read_by_one_task_when_the_read_has_one_core(
    spark, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's 2 cores give a window's read one (`_read_cores`): a window over the
    one-task limit is still read by one task, in order, and planned once; past what one
    step reads whole, in runs."""
    lines = put_files(settings)
    monkeypatch.setattr(landing_module, "ONE_TASK_MAX_BYTES", 100)
    assert landing_module._read_cores(spark) == 1
    offsets = SOURCE.offsets(settings, SOURCE.discover(settings, None))
    assert SOURCE.reads_in_order(spark, settings, offsets)
    assert SOURCE.window_read(spark, settings, offsets) == {"files": SOURCE.units(offsets)}
    assert read_rows(spark, settings) == (expected_rows(lines), 1)

    sizes = [int(size) for size in offsets["sizes"]]
    monkeypatch.setattr(landing_module, "WHOLE_READ_MAX_BYTES", max(sizes) + 1)
    monkeypatch.setattr(landing_module, "RUN_MAX_BYTES", 1000)
    assert sum(sizes) > max(sizes) + 1
    assert not SOURCE.reads_in_order(spark, settings, offsets)
    assert SOURCE.window_read(spark, settings, offsets) is None
    rows, partitions = read_rows(spark, settings)
    assert sorted(rows) == expected_rows(lines)
    assert partitions > 1


def test_a_planned_file_gone_before_the_read_is_a_source_error(settings: Settings) -> None:
    put_files(settings)
    offsets = SOURCE.offsets(settings, SOURCE.discover(settings, None))
    (settings.landing.path / SOURCE.folder / NAMES[2]).unlink()
    with pytest.raises(SourceError, match="missing"):
        SOURCE.read(None, settings, offsets)  # type: ignore[arg-type]  # checked before Spark


@pytest.mark.parametrize("splitter", ["whole", "line by line"])
def test_each_splitter_gives_every_line_once_at_its_position(
    settings: Settings, splitter: str
) -> None:
    """What a task yields for its files, by the reader it uses (no Spark)."""
    lines = put_files(settings)
    files = SOURCE.units(SOURCE.offsets(settings, SOURCE.discover(settings, None)))
    if splitter == "whole":
        rows = [
            (r["_file_idx"], r["_source_file"], r["_source_line"], r["_raw"])
            for batch in landing_module._split(settings.landing, files)
            for r in batch.to_pylist()
        ]
    else:
        rows = [
            row
            for idx, rel in enumerate(files)
            for row in landing_module._iter_lines(settings.landing.uri, idx, rel)
        ]
    assert rows == expected_rows(lines)


def _chunked(monkeypatch: pytest.MonkeyPatch, low: int, high: int) -> None:
    monkeypatch.setattr(landing_module, "CHUNK_MIN_BYTES", low)
    monkeypatch.setattr(landing_module, "CHUNK_MAX_BYTES", high)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 10, 64, 1000])
def test_a_file_split_in_byte_ranges_gives_every_line_once_at_its_position(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Ranges that cut lines anywhere (inside a line, at a newline, inside a blank line or a
    line longer than the range) give each line once, numbered as in its file (no Spark)."""
    lines = put_files(settings)
    long_line = b"x" * 50
    extra = {
        f"{SOURCE.folder}/f long.jsonl": [b"a", long_line, b"", b"", b"b", long_line],
        f"{SOURCE.folder}/g blanks.jsonl": [b"", b"", b"c"],
    }
    for rel, content in extra.items():
        (settings.landing.path / rel).write_bytes(b"\n".join(content) + b"\n")
    lines.update(extra)
    # The lines before a range counted a few bytes at a time, across many reads.
    monkeypatch.setattr(landing_module, "_COUNT_BLOCK_BYTES", 5)
    files = SOURCE.units(SOURCE.offsets(settings, SOURCE.discover(settings, None)))
    sizes = [(settings.landing / f).size() for f in files]
    units = [
        (i, start, min(size, start + chunk))
        for i, size in enumerate(sizes)
        for start in range(0, size, chunk)
    ]
    rows = [
        (r["_file_idx"], r["_source_file"], r["_source_line"], r["_raw"])
        for batch in landing_module._split_units(settings.landing, files, units)
        for r in batch.to_pylist()
    ]
    assert sorted(rows) == expected_rows(lines)


def test_a_large_window_has_a_read_task_for_each_core_and_none_over_the_chunk() -> None:
    mib = 1 << 20
    # One 200 MiB file on 2 cores: split at the largest chunk.
    units = landing_module._read_units([200 * mib], cores=2)
    assert len(units) == 7 and all(end - start <= 32 * mib for _, start, end in units)
    # One 30 MiB file on 2 cores: a range for each core.
    assert len(landing_module._read_units([30 * mib], cores=2)) == 2
    # Ten 20 MiB files on 2 cores: a file a task, as they are.
    assert landing_module._read_units([20 * mib] * 10, cores=2) == [(i, 0, None) for i in range(10)]
    # The same on 32 cores: every file in ranges, a task for every core or more.
    assert len(landing_module._read_units([20 * mib] * 10, cores=32)) >= 32
    # Never more tasks than MAX_READ_TASKS, however many cores.
    assert len(landing_module._read_units([1000 * mib], cores=1000)) <= 64


def test_a_large_window_is_read_in_a_run_of_units_a_core_more_runs_when_a_run_is_large() -> None:
    mib = 1 << 20
    # 100,000 payments (10 files, 19 MiB) on 2 cores: two runs of five files.
    assert landing_module._read_runs(10, 19 * mib, cores=2) == 2
    # A million (190 MiB): runs of at most 64 MiB, a multiple of the cores.
    assert landing_module._read_runs(10, 190 * mib, cores=2) == 4
    # Never more runs than units, nor than MAX_READ_TASKS.
    assert landing_module._read_runs(3, 19 * mib, cores=32) == 3
    assert landing_module._read_runs(1000, 100_000 * mib, cores=1000) == 64


def test_a_window_of_one_large_file_is_read_by_several_tasks(
    spark, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = put_files(settings)
    monkeypatch.setattr(landing_module, "ONE_TASK_MAX_BYTES", 100)
    _chunked(monkeypatch, 1000, 1000)
    monkeypatch.setattr(landing_module, "_read_cores", lambda spark: 10)
    rows, partitions = read_rows(spark, settings)
    assert sorted(rows) == expected_rows(lines)
    # The 5.3 KB file is read in six ranges, the four others whole: a unit a core.
    assert partitions == 4 + 6
