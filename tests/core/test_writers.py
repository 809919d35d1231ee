"""`run_writers`: every writer gets exactly its output's rows, however many outputs share a job."""

from __future__ import annotations

import datetime as dt
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from onceflow import _window_params as window_params
from onceflow.sinks.writers import (
    WRITERS_PARAM,
    ParquetFileWriter,
    PartitionHandle,
    PartitionWriter,
    WriterFailed,
    WritersPlan,
    close_all,
    failed_writer,
    rows_written,
    run_writers,
    spark_schema_to_arrow,
)
from onceflow.storage import Location

PAYMENTS_DDL = (
    "`id` STRING, `amount` BIGINT, `at` TIMESTAMP, `price` DECIMAL(12,2), "
    "`tags` ARRAY<STRING>, `with space` STRING"
)


def _payments(spark: Any) -> Any:
    at = dt.datetime(2024, 2, 29, 23, 59, 59, 123456)
    rows = [
        (f"p-{i}", i * (-1) ** i, at + dt.timedelta(hours=i), Decimal(i) / 4, ["x", str(i)], None)
        for i in range(40)
    ]
    rows.append(("p-nulls", None, None, None, None, "é 支付"))
    return spark.createDataFrame(rows, PAYMENTS_DDL)


def _writer(key: str, output: str, df: Any, root: Path, columns: list[str] | None = None) -> Any:
    schema = spark_schema_to_arrow(df.select(*columns) if columns else df)
    return ParquetFileWriter(key, output, Location(str(root / key)), "", schema)


def _written(root: Path, key: str) -> list[tuple[Any, ...]]:
    tables = [pq.read_table(f) for f in sorted((root / key).glob("*.parquet"))]
    if not tables:
        return []
    rows = pa.concat_tables(tables).to_pylist()
    return sorted((tuple(r.values()) for r in rows), key=repr)


def _expected(df: Any, columns: list[str] | None = None) -> list[tuple[Any, ...]]:
    picked = df.select(*columns) if columns else df
    return sorted((tuple(r.values()) for r in picked.toArrow().to_pylist()), key=repr)


@pytest.mark.parametrize("outputs", [("payments",), ("payments", "totals", "empty")])
def test_each_writer_gets_exactly_its_outputs_rows(
    spark: Any, tmp_path: Path, outputs: tuple[str, ...]
) -> None:
    frames = {
        "payments": _payments(spark),
        # Three partitions beside the others' one: every writer runs in every task.
        "totals": spark.range(50)
        .selectExpr("id % 7 AS k", "CAST(id AS DOUBLE) / 3 AS v")
        .repartition(3),
        "empty": spark.createDataFrame([], "x INT, y STRING"),
    }
    frames = {name: frames[name] for name in outputs}
    narrow = ["with space", "amount"]  # a second writer of one output, on other columns
    writers = [_writer("all", "payments", frames["payments"], tmp_path)]
    writers.append(_writer("narrow", "payments", frames["payments"], tmp_path, narrow))
    writers += [_writer(name, name, frames[name], tmp_path) for name in outputs[1:]]

    # Two measures computed in the same job, one of two rows whose objects merge.
    counts = frames["payments"].selectExpr("to_json(named_struct('rows', count(1))) AS result")
    both = counts.unionAll(
        frames["payments"].selectExpr("to_json(named_struct('negative', count_if(amount < 0)))")
    )
    job = run_writers(frames, writers, {"counts": counts, "both": both})
    assert job.measured == {"counts": {"rows": 41}, "both": {"rows": 41, "negative": 20}}
    results = job.written
    assert set(results) == {w.key for w in writers}

    assert _written(tmp_path, "all") == _expected(frames["payments"])
    assert _written(tmp_path, "narrow") == _expected(frames["payments"], narrow)
    assert rows_written(results["all"]) == rows_written(results["narrow"]) == 41
    for name in outputs[1:]:
        assert _written(tmp_path, name) == _expected(frames[name])
        assert rows_written(results[name]) == frames[name].count()


def test_a_writers_plan_runs_again_with_each_windows_own_fields(spark: Any, tmp_path: Path) -> None:
    frames = {"payments": _payments(spark), "totals": spark.range(5).selectExpr("id AS k")}

    def writers(folder: str) -> list[ParquetFileWriter]:
        return [
            ParquetFileWriter(
                name, name, Location(str(tmp_path / name)), folder,
                spark_schema_to_arrow(frames[name]),
            )
            for name in ("totals", "payments")
        ]  # fmt: skip

    plan = WritersPlan(frames, writers("w1"))
    for folder in ("w1", "w2"):
        now = writers(folder)
        assert plan.fits(frames, now)
        with window_params.bound(spark, {"window_id": 1, WRITERS_PARAM: plan.params(now)}):
            results = plan.run(now).written
        for name in ("payments", "totals"):
            parts = [p for p in results[name] if p["rows"]]
            assert parts and all(p["path"].startswith(f"{folder}/") for p in parts)
            files = sorted((tmp_path / name / folder).glob("*.parquet"))
            assert sum(pq.read_table(f).num_rows for f in files) == rows_written(parts)
    assert rows_written(results["payments"]) == 41

    # Another output's frame, or a writer that differs beyond its window's fields: no fit.
    assert not plan.fits({**frames, "totals": spark.range(5).selectExpr("id AS k")}, now)
    other = writers("w3")
    other[0].schema = pa.schema([pa.field("k", pa.int32())])
    assert not plan.fits(frames, other)
    # Run without the window's values, its tasks refuse to write another window's folder.
    with pytest.raises(Exception, match="without its window's writer values"):
        with window_params.bound(spark, {"window_id": 2}):
            plan.run(writers("w4"))
    assert not (tmp_path / "payments" / "w4").exists()


class _MeetingHandle(PartitionHandle):
    """A handle whose close waits for every other handle's close to start (or fails)."""

    def __init__(self, barrier: threading.Barrier, fail: bool = False) -> None:
        self.barrier = barrier
        self.fail = fail
        self.closed = False

    def write(self, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> dict[str, Any]:
        self.barrier.wait()  # BrokenBarrierError after its timeout if closes run in turn
        self.closed = True
        if self.fail:
            raise OSError("the upload failed")
        return {"rows": 0, "handle": id(self)}


def test_a_partitions_handles_close_at_once_and_every_one_closes() -> None:
    barrier = threading.Barrier(3, timeout=10)
    handles = [_MeetingHandle(barrier) for _ in range(3)]
    assert close_all(handles) == [{"rows": 0, "handle": id(h)} for h in handles]

    barrier = threading.Barrier(3, timeout=10)
    handles = [_MeetingHandle(barrier, fail=i == 0) for i in range(3)]
    with pytest.raises(OSError, match="the upload failed"):
        close_all(handles)
    assert all(h.closed for h in handles)  # a failure does not leave the others open


class _FailingHandle(PartitionHandle):
    def __init__(self, at: str) -> None:
        self.at = at

    def write(self, batch: pa.RecordBatch) -> None:
        if self.at == "write":
            raise ConnectionResetError("secret-value in a message")

    def close(self) -> dict[str, Any]:
        if self.at == "close":
            raise OSError("the upload failed")
        return {"rows": 0}


class _FailingWriter(PartitionWriter):
    def __init__(self, key: str, output: str, at: str) -> None:
        self.key = key
        self.output = output
        self.at = at

    def open(self, partition: int) -> PartitionHandle:
        if self.at == "open":
            raise PermissionError("no staging table")
        return _FailingHandle(self.at)


@pytest.mark.parametrize(
    ("at", "error"),
    [("write", "ConnectionResetError"), ("close", "OSError")],
)
def test_a_writers_failure_is_told_from_the_computations(
    spark: Any, tmp_path: Path, at: str, error: str
) -> None:
    """The window's write job is not run again when it fails: the driver needs to know whether
    a writer failed (retryable, the writer named) or the rows' computation did (the job's own
    error, raised as it is)."""
    frames = {"payments": _payments(spark), "totals": spark.range(5).selectExpr("id AS k")}
    writers = [
        _writer("ok", "payments", frames["payments"], tmp_path),
        _FailingWriter("pg_totals", "totals", at),
    ]
    with pytest.raises(Exception) as failed:
        run_writers(frames, writers)
    assert failed_writer(failed.value) == f"pg_totals ({error})"
    assert "secret-value" not in str(
        WriterFailed("pg_totals", ConnectionResetError("secret-value"))
    )

    def bad_rows(batches: Any) -> Any:
        for batch in batches:
            raise ZeroDivisionError("the transform divided by zero")
            yield batch

    broken = {"payments": _payments(spark).mapInArrow(bad_rows, PAYMENTS_DDL)}
    with pytest.raises(Exception, match="the transform divided by zero") as computed:
        run_writers(broken, [_writer("ok2", "payments", frames["payments"], tmp_path)])
    assert failed_writer(computed.value) is None
