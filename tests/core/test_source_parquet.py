"""ParquetSource: typed Parquet landing files, with every rule of the contract checked as a truth
table on the plain reader (`iter_parquet_file`, called as a Spark task calls it, through
`tests.support.typed_read`), and one test showing that the Spark path gives the same rows."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from onceflow.errors import ConfigurationError, SourceError
from onceflow.settings import Settings
from onceflow.sources._typed import arrow_schema, normalise_schema
from onceflow.sources.parquet import ParquetSource, iter_parquet_file
from tests.support.typed_read import read_plain as read
from tests.support.typed_read import read_spark

UTC = timezone.utc


@pytest.fixture()
def settings(tmp_path: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path, postgres_dsn=None, lake=tmp_path / "lake", landing=landing)


def put(settings: Settings, rel: str, table: pa.Table, **kwargs: Any) -> Path:
    path = settings.landing.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **kwargs)
    return path


def put_bytes(settings: Settings, rel: str, content: bytes) -> Path:
    path = settings.landing.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def by_line(rows: list[dict[str, Any]], *columns: str) -> dict[int, tuple[Any, ...]]:
    return {r["_source_line"]: tuple(r[c] for c in columns) for r in rows}


def one_column(settings: Settings, values: pa.Array, ctype: str) -> ParquetSource:
    put(settings, "t/a.parquet", pa.table({"v": values}))
    return ParquetSource("t", {"v": ctype})


# --- configuration -----------------------------------------------------------------------


def test_schema_is_normalised_and_the_source_is_job_data() -> None:
    source = ParquetSource("p", {"id": "BIGINT", "amount": "decimal( 10 , 2 )"})
    assert dict(source.schema) == {"id": "bigint", "amount": "decimal(10,2)"}
    assert source == ParquetSource("p", {"id": "bigint", "amount": "decimal(10,2)"})
    assert hash(source) == hash(ParquetSource("p", {"id": "bigint", "amount": "decimal(10,2)"}))
    assert pickle.loads(pickle.dumps(source)) == source
    assert dataclasses.replace(source, suffix=".pq").suffix == ".pq"
    assert ParquetSource("p", {"id": "int"}, ".pq").suffix == ".pq"
    assert source.suffix == ".parquet" and source.typed is True
    assert "p/*.parquet" in source.describe()


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({}, "schema is empty"),
        ({"id": "long"}, "unknown type 'long'"),
        ({"_raw": "string"}, "reserved"),
        ({"a-b": "string"}, "not a plain identifier"),
        ({"x": "decimal(10)"}, "unknown type"),
    ],
)
def test_bad_schema_is_a_configuration_error(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ParquetSource("p", schema)


# --- the frame ----------------------------------------------------------------------------


def test_the_spark_path_gives_the_plain_readers_rows(spark, settings: Settings) -> None:
    """The one Spark read of this file: columns taken by name with their types and row numbers,
    the same rows as the plain reader's over a second file with an invalid row and one missing a
    column, and an empty window (Spark still runs one task for it, which must yield nothing)."""
    table = pa.table(
        {
            "extra": ["x", "y"],
            "name": ["a", None],
            "id": pa.array([1, 2], pa.int64()),
            "small": pa.array([3, -4], pa.int32()),
            "price": [1.5, 2.25],
            "ok": [True, False],
            "day": [date(2024, 2, 29), date(1, 1, 1)],
            "at": pa.array(
                [datetime(2024, 1, 1, 12, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, tzinfo=UTC)],
                pa.timestamp("us", tz="UTC"),
            ),
            "amount": pa.array([Decimal("12.50"), Decimal("-0.01")], pa.decimal128(10, 2)),
        }
    )
    put(settings, "p/a.parquet", table)
    schema = {
        "id": "bigint",
        "small": "int",
        "amount": "decimal(10,2)",
        "price": "double",
        "ok": "boolean",
        "day": "date",
        "at": "timestamp",
        "name": "string",
    }
    source = ParquetSource("p", schema)
    frame = source.read(spark, settings, source.offsets(settings, source.discover(settings, None)))
    assert [(f.name, f.dataType.simpleString()) for f in frame.schema.fields] == [
        ("_file_idx", "int"),
        ("_source_file", "string"),
        ("_source_line", "bigint"),
        ("id", "bigint"),
        ("small", "int"),
        ("amount", "decimal(10,2)"),
        ("price", "double"),
        ("ok", "boolean"),
        ("day", "date"),
        ("at", "timestamp"),
        ("name", "string"),
        ("_reason", "string"),
        ("_raw_text", "string"),
    ]
    put(
        settings,
        "p/b.parquet",
        table.set_column(3, "small", pa.array([2**40, 3], pa.int64())).drop_columns(["extra"]),
    )
    put(settings, "p/c.parquet", table.drop_columns(["ok"]))
    spark_rows = read_spark(spark, settings, source)
    assert spark_rows == read(settings, source)
    assert [(r["_source_file"], r["_source_line"], r["_reason"]) for r in spark_rows[2:]] == [
        ("p/b.parquet", 1, "small: does not fit int without loss or overflow"),
        ("p/b.parquet", 2, None),
        ("p/c.parquet", 1, "missing column ok"),
        ("p/c.parquet", 2, "missing column ok"),
    ]
    empty = source.read(spark, settings, source.offsets(settings, []))
    assert empty.columns == [f.name for f in frame.schema.fields] and empty.count() == 0
    assert spark_rows[:2] == [
        {
            "_file_idx": 0,
            "_source_file": "p/a.parquet",
            "_source_line": 1,
            "id": 1,
            "small": 3,
            "amount": Decimal("12.50"),
            "price": 1.5,
            "ok": True,
            "day": date(2024, 2, 29),
            "at": "2024-01-01 12:00:00",
            "name": "a",
            "_reason": None,
            "_raw_text": None,
        },
        {
            "_file_idx": 0,
            "_source_file": "p/a.parquet",
            "_source_line": 2,
            "id": 2,
            "small": -4,
            "amount": Decimal("-0.01"),
            "price": 2.25,
            "ok": False,
            "day": date(1, 1, 1),
            "at": "9999-12-31 23:59:00",
            "name": None,
            "_reason": None,
            "_raw_text": None,
        },
    ]


def test_files_in_name_order_and_ignored_names(settings: Settings) -> None:
    for name in ("b", "a", "c"):
        put(settings, f"p/{name}.parquet", pa.table({"id": [f"{name}1", f"{name}2"]}))
    for ignored in (".hidden.parquet", "_SUCCESS.parquet", "x.parquet.tmp", "a.csv"):
        put(settings, f"p/{ignored}", pa.table({"id": ["ignored"]}))
    source = ParquetSource("p", {"id": "string"})
    assert source.discover(settings, None) == ["p/a.parquet", "p/b.parquet", "p/c.parquet"]
    rows = read(settings, source)
    assert [(r["_file_idx"], r["_source_file"], r["_source_line"], r["id"]) for r in rows] == [
        (0, "p/a.parquet", 1, "a1"),
        (0, "p/a.parquet", 2, "a2"),
        (1, "p/b.parquet", 1, "b1"),
        (1, "p/b.parquet", 2, "b2"),
        (2, "p/c.parquet", 1, "c1"),
        (2, "p/c.parquet", 2, "c2"),
    ]


def test_row_numbers_run_across_row_groups_and_batches(settings: Settings) -> None:
    n = 150_000  # more than one Arrow batch (65,536 rows) and several row groups
    values = [i if i % 50_000 else 2**40 for i in range(1, n + 1)]
    put(
        settings,
        "p/a.parquet",
        pa.table({"v": pa.array(values, pa.int64())}),
        row_group_size=40_000,
    )
    source = ParquetSource("p", {"v": "int"})
    rows = read(settings, source)
    assert {
        "n": len(rows),
        "bad": sum(r["_reason"] is not None for r in rows),
        "total": sum(r["v"] for r in rows if r["v"] is not None),
        "last": max(r["_source_line"] for r in rows),
    } == {
        "n": n,
        "bad": 3,
        "total": sum(range(1, n + 1)) - 50_000 - 100_000 - 150_000,
        "last": n,
    }
    bad = [(r["_source_line"], r["_raw_text"]) for r in rows if r["_reason"] is not None]
    assert sorted(bad) == [
        (50_000, '{"v":1099511627776}'),
        (100_000, '{"v":1099511627776}'),
        (150_000, '{"v":1099511627776}'),
    ]


def test_empty_file_and_empty_window(settings: Settings) -> None:
    put(settings, "p/a.parquet", pa.table({"id": pa.array([], pa.int64())}))
    source = ParquetSource("p", {"id": "bigint"})
    assert read(settings, source) == []
    # The frame's columns of an empty window: test_the_spark_path_gives_the_plain_readers_rows.
    assert read(settings, source, source.offsets(settings, [])) == []
    assert arrow_schema(source.schema).names == [
        "_file_idx",
        "_source_file",
        "_source_line",
        "id",
        "_reason",
        "_raw_text",
    ]


# --- casts ----------------------------------------------------------------------------------


def test_integer_overflow_and_lossy_floats_make_rows_invalid(settings: Settings) -> None:
    table = pa.table(
        {
            "i": pa.array([1, 2**31, None, -(2**31) - 1, 5], pa.int64()),
            "b": pa.array([1.0, 2.0, 2.5, float("nan"), 1e20], pa.float64()),
            "u": pa.array([0, 2**63 - 1, 1, 2**63, 3], pa.uint64()),
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"i": "int", "b": "bigint", "u": "bigint"}))
    assert by_line(rows, "i", "b", "u", "_reason", "_raw_text") == {
        1: (1, 1, 0, None, None),
        2: (
            None,
            None,
            None,
            "i: does not fit int without loss or overflow",
            '{"i":2147483648,"b":2.0,"u":9223372036854775807}',
        ),
        3: (
            None,
            None,
            None,
            "b: does not fit bigint without loss or overflow",
            '{"i":null,"b":2.5,"u":1}',
        ),
        4: (
            None,
            None,
            None,
            "i: does not fit int without loss or overflow; b: does not fit bigint without loss "
            "or overflow; u: does not fit bigint without loss or overflow",
            '{"i":-2147483649,"b":NaN,"u":9223372036854775808}',
        ),
        5: (
            None,
            None,
            None,
            "b: does not fit bigint without loss or overflow",
            '{"i":5,"b":1e+20,"u":3}',
        ),
    }


def test_decimal_scale_and_precision(settings: Settings) -> None:
    table = pa.table(
        {
            "d": pa.array(
                [Decimal("1.230"), Decimal("1.234"), Decimal("123.450"), Decimal("1234.500")],
                pa.decimal128(10, 3),
            ),
            "n": pa.array([123, 999, -999, 1000], pa.int64()),
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"d": "decimal(5,2)", "n": "decimal(5,2)"}))
    assert by_line(rows, "d", "n", "_reason", "_raw_text") == {
        1: (Decimal("1.23"), Decimal("123.00"), None, None),
        2: (
            None,
            None,
            "d: does not fit decimal(5,2) without loss or overflow",
            '{"d":"1.234","n":999}',
        ),
        3: (Decimal("123.45"), Decimal("-999.00"), None, None),
        4: (
            None,
            None,
            "d: does not fit decimal(5,2) without loss or overflow; "
            "n: does not fit decimal(5,2) without loss or overflow",
            '{"d":"1234.500","n":1000}',
        ),
    }


def test_integer_into_decimal_with_a_large_scale(settings: Settings) -> None:
    rows = read(
        settings,
        one_column(settings, pa.array([7, 10**19 - 1], pa.uint64()), "decimal(38,20)"),
    )
    assert by_line(rows, "v", "_reason") == {
        1: (Decimal("7." + "0" * 20), None),
        2: (None, "v: too large for decimal(38,20)"),
    }


def test_doubles_refuse_nan_infinity_and_lossy_sources(settings: Settings) -> None:
    table = pa.table(
        {
            "f": pa.array([0.5, float("nan"), float("inf"), 1.0, 2.0], pa.float64()),
            "i": pa.array([2**53, 3, 4, 2**53 + 1, 6], pa.int64()),
            "d": pa.array(
                [
                    Decimal("0.1"),
                    Decimal("1"),
                    Decimal("2"),
                    Decimal("3"),
                    Decimal("0.1234567890123456789"),
                ],
                pa.decimal128(20, 19),
            ),
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"f": "double", "i": "double", "d": "double"}))
    assert by_line(rows, "f", "i", "d", "_reason") == {
        1: (0.5, float(2**53), 0.1, None),
        2: (None, None, None, "f: NaN or infinity is not accepted"),
        3: (None, None, None, "f: NaN or infinity is not accepted"),
        4: (None, None, None, "i: does not fit double without loss or overflow"),
        5: (None, None, None, "d: does not fit double without loss"),
    }


def test_timestamps_naive_as_utc_zoned_converted_and_precision(settings: Settings) -> None:
    naive = pa.array([datetime(2024, 1, 1, 12), datetime(2024, 1, 1, 12)], pa.timestamp("ms"))
    zoned = pa.array(
        [datetime(2024, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))] * 2,
        pa.timestamp("us", tz="+02:00"),
    )
    nanos = pa.array([1_704_067_200_123_456_000, 1_704_067_200_123_456_789], pa.timestamp("ns"))
    seconds = pa.array([0, 300_000_000_000], pa.timestamp("s", tz="UTC"))
    days = pa.array([date(2024, 3, 1), date(2024, 3, 2)], pa.date32())
    put(
        settings,
        "p/a.parquet",
        pa.table(
            {"naive": naive, "zoned": zoned, "nanos": nanos, "seconds": seconds, "days": days}
        ),
        coerce_timestamps=None,
        version="2.6",
    )
    schema = dict.fromkeys(("naive", "zoned", "nanos", "seconds", "days"), "timestamp")
    rows = read(settings, ParquetSource("p", schema))
    assert by_line(rows, "naive", "zoned", "nanos", "seconds", "days", "_reason") == {
        1: (
            "2024-01-01 12:00:00",
            "2024-01-01 10:00:00",
            "2024-01-01 00:00:00.123456",
            "1970-01-01 00:00:00",
            "2024-03-01 00:00:00",
            None,
        ),
        2: (
            None,
            None,
            None,
            None,
            None,
            "nanos: does not fit timestamp without loss or overflow; seconds: outside the years "
            "1-9999",
        ),
    }


def test_dates_in_range(settings: Settings) -> None:
    days = pa.array([date(2024, 2, 29), None, 3_000_000], pa.date32())  # 3,000,000: year 10183
    rows = read(settings, one_column(settings, days, "date"))
    assert by_line(rows, "v", "_reason", "_raw_text") == {
        1: (date(2024, 2, 29), None, None),
        2: (None, None, None),
        # Python cannot hold the date; the quarantine gets it as Arrow prints it.
        3: (None, "v: outside the years 1-9999", '{"v":"10183-09-21"}'),
    }


def test_date_column_declared_timestamp_is_midnight_utc(settings: Settings) -> None:
    rows = read(settings, one_column(settings, pa.array([date(2024, 3, 1)]), "timestamp"))
    assert by_line(rows, "v", "_reason") == {1: ("2024-03-01 00:00:00", None)}


def test_string_columns_are_parsed_by_the_text_rules(settings: Settings) -> None:
    table = pa.table(
        {
            "n": ["42", " 7 ", "4.2", "", None],
            "t": [
                "2024-01-01T00:00:00+01:00",
                "2024-01-01T00:00:00Z",
                "x",
                None,
                "2024-01-01T00:00:00",
            ],
            "ok": ["true", "FALSE", "false", "yes", None],
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"n": "bigint", "t": "timestamp", "ok": "boolean"}))
    assert by_line(rows, "n", "t", "ok", "_reason", "_raw_text") == {
        1: (42, "2023-12-31 23:00:00", True, None, None),
        2: (7, "2024-01-01 00:00:00", False, None, None),
        3: (
            None,
            None,
            None,
            "n: not an integer; t: not an RFC 3339 timestamp (YYYY-MM-DDTHH:MM:SS[.ffffff]Z or "
            "±HH:MM)",
            '{"n":"4.2","t":"x","ok":"false"}',
        ),
        4: (None, None, None, "ok: not a boolean (true or false)", '{"n":"","t":null,"ok":"yes"}'),
        5: (
            None,
            None,
            None,
            "t: timestamp has no UTC offset (add Z or ±HH:MM)",
            '{"n":null,"t":"2024-01-01T00:00:00","ok":null}',
        ),
    }


def test_strings_binary_nul_and_dictionary(settings: Settings) -> None:
    table = pa.table(
        {
            "s": pa.array(["plain", "a\x00b", "été", "x"]).dictionary_encode(),
            "b": pa.array([b"ok", b"fine", b"\xff\xfe", None], pa.binary()),
            "l": pa.array(["1", "2", "3", "4"], pa.large_string()),
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"s": "string", "b": "string", "l": "string"}))
    assert by_line(rows, "s", "b", "l", "_reason", "_raw_text") == {
        1: ("plain", "ok", "1", None, None),
        2: (
            None,
            None,
            None,
            "s: contains U+0000, which PostgreSQL text cannot store",
            '{"s":"a\\u0000b","b":"b\'fine\'","l":"2"}',
        ),
        3: (None, None, None, "b: invalid UTF-8", '{"s":"été","b":"b\'\\\\xff\\\\xfe\'","l":"3"}'),
        4: ("x", None, "4", None, None),
    }


def test_all_null_column_reads_as_nulls(settings: Settings) -> None:
    table = pa.table({"id": [1, 2], "gone": pa.nulls(2)})
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"id": "bigint", "gone": "timestamp"}))
    assert by_line(rows, "id", "gone", "_reason") == {1: (1, None, None), 2: (2, None, None)}


# --- file-level problems --------------------------------------------------------------------


def test_missing_column_makes_every_row_invalid(settings: Settings) -> None:
    put(settings, "p/a.parquet", pa.table({"id": [1, 2], "amt": [3, 4]}))
    put(settings, "p/b.parquet", pa.table({"id": [5], "amount": [6]}))
    rows = read(settings, ParquetSource("p", {"id": "bigint", "amount": "bigint"}))
    assert [
        (r["_source_file"], r["_source_line"], r["id"], r["amount"], r["_reason"], r["_raw_text"])
        for r in rows
    ] == [
        ("p/a.parquet", 1, None, None, "missing column amount", '{"id":1,"amt":3}'),
        ("p/a.parquet", 2, None, None, "missing column amount", '{"id":2,"amt":4}'),
        ("p/b.parquet", 1, 5, 6, None, None),
    ]


def test_several_missing_and_mismatched_columns(settings: Settings) -> None:
    put(settings, "p/a.parquet", pa.table({"flag": [True], "n": [1]}))
    schema = {"flag": "date", "n": "string", "x": "int", "y": "int"}
    rows = read(settings, ParquetSource("p", schema))
    assert by_line(rows, "_reason", "_raw_text") == {
        1: (
            "missing columns x, y; column flag is bool, which cannot be read as date; "
            "column n is int64, which cannot be read as string",
            '{"flag":true,"n":1}',
        )
    }


def test_column_twice_in_a_file_makes_every_row_invalid(settings: Settings) -> None:
    table = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["id", "id"])
    path = put(settings, "p/a.parquet", table)
    batches = list(iter_parquet_file(path, 0, "p/a.parquet", normalise_schema({"id": "int"}, "t")))
    rows = pa.Table.from_batches(batches).to_pylist()
    assert [(r["_source_line"], r["id"], r["_reason"]) for r in rows] == [
        (1, None, "column id appears more than once in the file")
    ]


def test_unreadable_files_are_reported_as_one_row(settings: Settings) -> None:
    put(settings, "p/a.parquet", pa.table({"id": [1]}))
    put_bytes(settings, "p/b.parquet", b"this is not parquet")
    put_bytes(settings, "p/c.parquet", b"")
    good = (settings.landing.path / "p/a.parquet").read_bytes()
    put_bytes(settings, "p/d.parquet", good[: len(good) // 2])  # truncated: no footer
    put(settings, "p/e.parquet", pa.table({"id": [2]}))
    rows = read(settings, ParquetSource("p", {"id": "bigint"}))
    reason = "not a readable Parquet file: ArrowInvalid"
    assert [
        (
            r["_file_idx"],
            r["_source_file"],
            r["_source_line"],
            r["id"],
            r["_reason"],
            r["_raw_text"],
        )
        for r in rows
    ] == [
        (0, "p/a.parquet", 1, 1, None, None),
        (1, "p/b.parquet", 0, None, reason, ""),
        (2, "p/c.parquet", 0, None, reason, ""),
        (3, "p/d.parquet", 0, None, reason, ""),
        (4, "p/e.parquet", 1, 2, None, None),
    ]


def test_damage_found_mid_file_keeps_the_rows_before_it(settings: Settings) -> None:
    table = pa.table({"v": pa.array(range(1000), pa.int64())})
    path = put(
        settings,
        "p/a.parquet",
        table,
        row_group_size=500,
        write_page_checksum=True,
        use_dictionary=False,
        compression="none",
    )
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    data[column.data_page_offset + 200] ^= 0xFF  # inside the second row group's page values
    path.write_bytes(bytes(data))
    schema = normalise_schema({"v": "bigint"}, "t")
    rows = pa.Table.from_batches(
        list(iter_parquet_file(path, 3, "p/a.parquet", schema, batch_rows=500))
    ).to_pylist()
    assert [r["v"] for r in rows[:500]] == list(range(500))
    assert [r["_source_line"] for r in rows[:500]] == list(range(1, 501))
    assert rows[500:] == [
        {
            "_file_idx": 3,
            "_source_file": "p/a.parquet",
            "_source_line": 0,
            "v": None,
            "_reason": "not a readable Parquet file after row 500: OSError",
            "_raw_text": "",
        }
    ]


def test_missing_file_at_read_is_a_source_error(settings: Settings) -> None:
    put(settings, "p/a.parquet", pa.table({"id": [1]}))
    source = ParquetSource("p", {"id": "bigint"})
    offsets = source.offsets(settings, source.discover(settings, None))
    (settings.landing.path / "p/a.parquet").unlink()
    with pytest.raises(SourceError, match=re.escape("p/a.parquet: missing")):
        source.read(None, settings, offsets)  # type: ignore[arg-type]  # checked before Spark


def test_file_gone_on_the_executor_fails_instead_of_quarantining(settings: Settings) -> None:
    schema = normalise_schema({"id": "int"}, "t")
    with pytest.raises(FileNotFoundError):
        list(
            iter_parquet_file(settings.landing.path / "p/none.parquet", 0, "p/none.parquet", schema)
        )


def test_raw_text_is_compact_json_of_the_declared_columns(settings: Settings) -> None:
    table = pa.table(
        {
            "at": pa.array([datetime(2024, 1, 1, 12, 0, 0, 1)], pa.timestamp("us")),
            "n": pa.array([2**40], pa.int64()),
            "secret_extra": ["not in the schema"],
        }
    )
    put(settings, "p/a.parquet", table)
    rows = read(settings, ParquetSource("p", {"n": "int", "at": "timestamp"}))
    assert rows[0]["_reason"] == "n: does not fit int without loss or overflow"
    assert json.loads(rows[0]["_raw_text"]) == {"n": 2**40, "at": "2024-01-01 12:00:00.000001"}
    assert rows[0]["_raw_text"] == '{"n":1099511627776,"at":"2024-01-01 12:00:00.000001"}'


def test_a_required_column_without_a_value_is_invalid(tmp_path: Path) -> None:
    source = ParquetSource(
        "orders", schema={"order_id": "string", "n": "bigint"}, required=("order_id", "n")
    )
    path = tmp_path / "orders.parquet"
    pq.write_table(
        pa.table({"order_id": ["o1", "", None, " ", "o5"], "n": [1, 2, 3, 4, None]}), path
    )
    batches = list(
        iter_parquet_file(path, 0, "orders/orders.parquet", source.schema,
                          required=source.required)
    )  # fmt: skip
    rows = [r for b in batches for r in b.to_pylist()]
    assert [r["_reason"] for r in rows] == [
        None,
        "order_id: required, but empty",
        "order_id: required, but empty",
        "order_id: required, but empty",
        "n: required, but empty",
    ]
    assert rows[1]["_raw_text"] == '{"order_id":"","n":2}'
    assert rows[1]["order_id"] is None and rows[0]["order_id"] == "o1"

    # raw_text: every row keeps its JSON, valid ones too.
    kept = list(iter_parquet_file(path, 0, "o.parquet", source.schema, raw_text=True))
    assert kept[0].to_pylist()[0]["_raw_text"] == '{"order_id":"o1","n":1}'
