"""CsvSource: typed CSV landing files, with every rule of the contract checked as a truth table
on the plain reader (`iter_csv_file`, called as a Spark task calls it, through
`tests.support.typed_read`), and one test showing that the Spark path gives the same rows."""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections.abc import Mapping
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from onceflow.errors import ConfigurationError, SourceError
from onceflow.settings import Settings
from onceflow.sources._typed import arrow_schema
from onceflow.sources.csv import CsvSource
from tests.support.typed_read import read_plain as read
from tests.support.typed_read import read_spark

POSITION = ["_file_idx", "_source_file", "_source_line"]


@pytest.fixture()
def settings(tmp_path: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path, postgres_dsn=None, lake=tmp_path / "lake", landing=landing)


def put(settings: Settings, rel: str, content: str | bytes) -> Path:
    path = settings.landing.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def by_line(rows: list[dict[str, Any]], *columns: str) -> dict[int, tuple[Any, ...]]:
    return {r["_source_line"]: tuple(r[c] for c in columns) for r in rows}


# --- configuration -----------------------------------------------------------------------


def test_schema_is_normalised_hashable_and_readable_as_mapping() -> None:
    source = CsvSource("pay", {"id": " BIGINT ", "amount": "Decimal(12, 2)", "at": "timestamp"})
    assert isinstance(source.schema, Mapping)
    assert dict(source.schema) == {"id": "bigint", "amount": "decimal(12,2)", "at": "timestamp"}
    assert list(source.schema) == ["id", "amount", "at"]
    assert source.schema["amount"] == "decimal(12,2)"
    assert source.schema == {"id": "bigint", "amount": "decimal(12,2)", "at": "timestamp"}
    same = CsvSource("pay", {"id": "bigint", "amount": "decimal(12,2)", "at": "timestamp"})
    assert source == same and hash(source) == hash(same)
    assert source != CsvSource(
        "pay", {"amount": "decimal(12,2)", "id": "bigint", "at": "timestamp"}
    )
    assert pickle.loads(pickle.dumps(source)) == source
    assert dataclasses.replace(source, header=False).header is False
    # Positional order is (folder, schema, suffix, delimiter, header).
    positional = CsvSource("pay", {"id": "int"}, ".txt", ";", False)
    assert (positional.suffix, positional.delimiter, positional.header) == (".txt", ";", False)
    assert source.typed is True
    assert "pay/*.csv" in source.describe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.folder = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({}, "schema is empty"),
        ({"id": "integer"}, "unknown type 'integer'"),
        ({"id": "varchar(10)"}, "unknown type"),
        ({"id": 5}, "type must be a string"),
        ({"_id": "int"}, "reserved"),
        ({"bad name": "int"}, "not a plain identifier"),
        ({"1abc": "int"}, "not a plain identifier"),
        ({"x" * 64: "int"}, "bytes long"),
        ({"Amount": "int", "amount": "int"}, "differ only in case"),
        ({"x": "decimal(39,0)"}, "out of bounds"),
        ({"x": "decimal(5,6)"}, "out of bounds"),
        ({"x": "decimal(0,0)"}, "out of bounds"),
        (["id"], "must be a mapping"),
    ],
)
def test_bad_schema_is_a_configuration_error(schema: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        CsvSource("pay", schema)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delimiter": ",,"}, "delimiter must be one character"),
        ({"delimiter": '"'}, "delimiter must be one character"),
        ({"delimiter": "\n"}, "delimiter must be one character"),
        ({"header": "yes"}, "header must be True or False"),
        ({"suffix": ""}, "suffix must be a non-empty"),
    ],
)
def test_bad_options_are_configuration_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        CsvSource("pay", {"id": "int"}, **kwargs)


def test_empty_folder_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="folder must be a non-empty"):
        CsvSource("", {"id": "int"})


# --- the frame ----------------------------------------------------------------------------


def test_the_spark_path_gives_the_plain_readers_rows(spark, settings: Settings) -> None:
    """The one Spark read of this file: the frame's columns and types, and the same rows as the
    plain reader, for valid, invalid and multi-line records over two files and for an empty
    window (Spark still runs one task for it, which must yield nothing)."""
    put(
        settings,
        "pay/a.csv",
        "id,small,amount,price,ok,day,at,name\n"
        '1,-5,12.50,2.5e1,TRUE,2024-02-29,2024-01-01T12:00:00+02:00,"Smith, ""J"""\n',
    )
    schema = {
        "id": "bigint",
        "small": "int",
        "amount": "decimal(12,2)",
        "price": "double",
        "ok": "boolean",
        "day": "date",
        "at": "timestamp",
        "name": "string",
    }
    source = CsvSource("pay", schema)
    offsets = source.offsets(settings, source.discover(settings, None))
    frame = source.read(spark, settings, offsets)
    assert [(f.name, f.dataType.simpleString()) for f in frame.schema.fields] == [
        ("_file_idx", "int"),
        ("_source_file", "string"),
        ("_source_line", "bigint"),
        ("id", "bigint"),
        ("small", "int"),
        ("amount", "decimal(12,2)"),
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
        "pay/b.csv",
        "id,small,amount,price,ok,day,at,name\n"  # 1
        '2,1,1.5,1,false,2024-01-01,2024-01-01 00:00:00.5Z,"two\nlines"\n'  # 2-3
        "x,1,1,1,true,2024-01-01,2024-01-01T00:00:00Z,bad id\n"  # 4
        "5,1\n",  # 5
    )
    spark_rows = read_spark(spark, settings, source)
    assert spark_rows == read(settings, source)
    assert [(r["_source_line"], r["_reason"]) for r in spark_rows[1:]] == [
        (2, None),
        (4, "id: not an integer"),
        (5, "expected 8 fields, got 2"),
    ]
    assert spark_rows[1]["at"] == "2024-01-01 00:00:00.5"
    empty = source.read(spark, settings, source.offsets(settings, []))
    assert empty.columns == [f.name for f in frame.schema.fields] and empty.count() == 0
    assert spark_rows[:1] == [
        {
            "_file_idx": 0,
            "_source_file": "pay/a.csv",
            "_source_line": 2,
            "id": 1,
            "small": -5,
            "amount": Decimal("12.50"),
            "price": 25.0,
            "ok": True,
            "day": date(2024, 2, 29),
            "at": "2024-01-01 10:00:00",
            "name": 'Smith, "J"',
            "_reason": None,
            "_raw_text": None,
        }
    ]


def test_files_in_name_order_and_ignored_names(settings: Settings) -> None:
    for name in ("b.csv", "a.csv", "c.csv"):
        put(settings, f"pay/{name}", f"id\n{name[0]}1\n{name[0]}2\n")
    for ignored in (".hidden.csv", "_partial.csv", "x.csv.tmp", "notes.txt"):
        put(settings, f"pay/{ignored}", "id\nignored\n")
    (settings.landing.path / "pay" / "dir.csv").mkdir()
    put(settings, "other/z.csv", "id\nother\n")
    source = CsvSource("pay", {"id": "string"})
    assert source.discover(settings, None) == ["pay/a.csv", "pay/b.csv", "pay/c.csv"]
    rows = read(settings, source)
    assert [(r["_file_idx"], r["_source_file"], r["_source_line"], r["id"]) for r in rows] == [
        (0, "pay/a.csv", 2, "a1"),
        (0, "pay/a.csv", 3, "a2"),
        (1, "pay/b.csv", 2, "b1"),
        (1, "pay/b.csv", 3, "b2"),
        (2, "pay/c.csv", 2, "c1"),
        (2, "pay/c.csv", 3, "c2"),
    ]


def test_line_numbers_blank_lines_and_multiline_quoted_fields(settings: Settings) -> None:
    put(
        settings,
        "t/a.csv",
        "id,note\n"  # 1: header
        "1,plain\n"  # 2
        "\n"  # 3: empty, not a record
        "   \t \n"  # 4: whitespace only, not a record
        '2,"first\n'  # 5: a record over three lines
        "\n"  # 6: blank inside quotes is data
        'third, with comma"\n'  # 7
        "3,last\n",  # 8
    )
    rows = read(settings, CsvSource("t", {"id": "int", "note": "string"}))
    assert by_line(rows, "id", "note", "_reason") == {
        2: (1, "plain", None),
        5: (2, "first\n\nthird, with comma", None),
        8: (3, "last", None),
    }


def test_crlf_line_endings(settings: Settings) -> None:
    put(settings, "t/a.csv", b'id,note\r\n1,"a\r\nb"\r\n2,x\r\n3,bad,extra\r\n')
    rows = read(settings, CsvSource("t", {"id": "int", "note": "string"}))
    assert by_line(rows, "id", "note", "_reason", "_raw_text") == {
        2: (1, "a\r\nb", None, None),
        4: (2, "x", None, None),
        5: (None, None, "expected 2 fields, got 3", "3,bad,extra"),
    }


def test_last_line_without_newline(settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n2")
    rows = read(settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "id") == {2: (1,), 3: (2,)}


def test_empty_file_and_header_only_file_give_no_rows(settings: Settings) -> None:
    put(settings, "t/a.csv", "")
    put(settings, "t/b.csv", "id\n")
    put(settings, "t/c.csv", "id\n5\n")
    rows = read(settings, CsvSource("t", {"id": "int"}))
    assert [(r["_source_file"], r["_source_line"], r["id"]) for r in rows] == [("t/c.csv", 2, 5)]


def test_empty_window_reads_no_rows(settings: Settings) -> None:
    # The frame's columns of an empty window: test_the_spark_path_gives_the_plain_readers_rows.
    source = CsvSource("t", {"id": "int"})
    assert read(settings, source, source.offsets(settings, [])) == []
    assert arrow_schema(source.schema).names == [*POSITION, "id", "_reason", "_raw_text"]


# --- header ---------------------------------------------------------------------------------


def test_header_matches_by_name_order_free_extras_ignored(settings: Settings) -> None:
    put(settings, "t/a.csv", "extra, amount ,id\nzzz,1.50,7\n")
    rows = read(settings, CsvSource("t", {"id": "int", "amount": "decimal(5,2)"}))
    assert by_line(rows, "id", "amount", "_reason") == {2: (7, Decimal("1.50"), None)}


def test_header_with_byte_order_mark(settings: Settings) -> None:
    put(settings, "t/a.csv", b"\xef\xbb\xbfid,name\n1,x\n")
    rows = read(settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason") == {2: (1, "x", None)}


def test_header_lacking_columns_quarantines_the_file(settings: Settings) -> None:
    put(settings, "t/a.csv", "id,amount,currency\n1,2,EUR\n")
    put(settings, "t/b.csv", "id,amt\n1,2\n\n3,4\n")
    schema = {"id": "int", "amount": "int", "currency": "string"}
    rows = read(settings, CsvSource("t", schema))
    reason = "header lacks columns amount, currency"
    assert [
        (r["_source_file"], r["_source_line"], r["id"], r["_reason"], r["_raw_text"]) for r in rows
    ] == [
        ("t/a.csv", 2, 1, None, None),
        ("t/b.csv", 1, None, reason, "id,amt"),
        ("t/b.csv", 2, None, reason, "1,2"),
        ("t/b.csv", 4, None, reason, "3,4"),
    ]


def test_header_lacking_one_column(settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    rows = read(settings, CsvSource("t", {"id": "int", "amount": "int"}))
    assert by_line(rows, "_reason") == {
        1: ("header lacks column amount",),
        2: ("header lacks column amount",),
    }


def test_header_naming_a_column_twice_quarantines_the_file(settings: Settings) -> None:
    put(settings, "t/a.csv", "id,id,x\n1,2,3\n")
    rows = read(settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "_reason", "_raw_text") == {
        1: ("header names id more than once", "id,id,x"),
        2: ("header names id more than once", "1,2,3"),
    }


def test_no_header_takes_fields_in_schema_order(settings: Settings) -> None:
    put(settings, "t/a.csv", "id,amount\n1,2\n")
    rows = read(settings, CsvSource("t", {"id": "string", "amount": "int"}, header=False))
    assert by_line(rows, "id", "amount", "_reason") == {
        1: (None, None, "amount: not an integer"),
        2: ("1", 2, None),
    }


def test_field_count_must_match(settings: Settings) -> None:
    put(settings, "t/a.csv", "a,b,c\n1,2,3\n1,2\n1,2,3,4\n,,\n")
    rows = read(settings, CsvSource("t", {"a": "int", "c": "int"}))
    assert by_line(rows, "a", "c", "_reason", "_raw_text") == {
        2: (1, 3, None, None),
        3: (None, None, "expected 3 fields, got 2", "1,2"),
        4: (None, None, "expected 3 fields, got 4", "1,2,3,4"),
        5: (None, None, None, None),
    }


def test_field_count_without_header(settings: Settings) -> None:
    put(settings, "t/a.csv", "1\n1,2,3\n")
    rows = read(settings, CsvSource("t", {"a": "int", "b": "int"}, header=False))
    assert by_line(rows, "_reason") == {
        1: ("expected 2 fields, got 1",),
        2: ("expected 2 fields, got 3",),
    }


def test_other_delimiters(settings: Settings) -> None:
    put(settings, "semi/a.csv", 'id;name\n1;"a;b"\n2,5;x\n')
    put(settings, "tab/a.tsv", "id\tname\n1\ta,b\n")
    semi = read(settings, CsvSource("semi", {"id": "int", "name": "string"}, delimiter=";"))
    assert by_line(semi, "id", "name", "_reason") == {
        2: (1, "a;b", None),
        3: (None, None, "id: not an integer"),
    }
    tab = CsvSource("tab", {"id": "int", "name": "string"}, suffix=".tsv", delimiter="\t")
    assert by_line(read(settings, tab), "id", "name") == {2: (1, "a,b")}


# --- malformed input ------------------------------------------------------------------------


def test_invalid_utf8_quarantines_only_its_record(settings: Settings) -> None:
    put(
        settings,
        "t/a.csv",
        b'id,name\n1,ok\n2,caf\xe9\n3,"multi\nline \xff"\n4,\xc3\xa9t\xc3\xa9\n',
    )
    rows = read(settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason", "_raw_text") == {
        2: (1, "ok", None, None),
        3: (None, None, "invalid UTF-8", "2,caf\\xe9"),
        4: (None, None, "invalid UTF-8", '3,"multi\nline \\xff"'),
        6: (4, "été", None, None),
    }


def test_header_with_invalid_utf8_quarantines_the_file(settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,n\xffame\n1,x\n")
    rows = read(settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "_reason", "_raw_text") == {
        1: ("header: invalid UTF-8", "id,n\\xffame"),
        2: ("header: invalid UTF-8", "1,x"),
    }


def test_malformed_quoting_is_one_invalid_record(settings: Settings) -> None:
    put(settings, "t/a.csv", 'id,name\n1,"ab"c\n2,ok\n3,a"b\n')
    rows = read(settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason", "_raw_text") == {
        2: (None, None, "malformed CSV: ',' expected after '\"'", '1,"ab"c'),
        3: (2, "ok", None, None),
        # A quote inside an unquoted field is a literal character (RFC 4180 leniency of csv).
        4: (3, 'a"b', None, None),
    }


UNTERMINATED = "unterminated quote on this line; the lines after it are read on their own"


def test_an_unterminated_quote_costs_only_its_line(settings) -> None:
    # Open to the end of the file, and open until a later line's quote that cannot close it:
    # the valid records after the stray quote are delivered, never taken into its record.
    put(settings, "a/a.csv", 'id,name\n1,ok\n2,"open\n3,kept\n\n4,x\n')
    put(settings, "b/b.csv", 'id,name\n5,"open\n"6",kept\n7,x\n')
    schema = {"id": "int", "name": "string"}
    assert by_line(read(settings, CsvSource("a", schema)), "id", "_reason", "_raw_text") == {
        2: (1, None, None),
        3: (None, f"malformed CSV: unexpected end of data ({UNTERMINATED})", '2,"open'),
        4: (3, None, None),
        6: (4, None, None),
    }
    assert by_line(read(settings, CsvSource("b", schema)), "id", "_reason", "_raw_text") == {
        2: (None, f"malformed CSV: ',' expected after '\"' ({UNTERMINATED})", '5,"open'),
        3: (6, None, None),
        4: (7, None, None),
    }


def test_stray_carriage_return_is_malformed(settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,name\n1,a\rb\n2,ok\n")
    rows = read(settings, CsvSource("t", {"id": "int", "name": "string"}))
    reasons = by_line(rows, "id", "_reason", "_raw_text")
    assert reasons[2][0] is None
    assert reasons[2][1].startswith("malformed CSV: new-line character seen in unquoted field")
    assert reasons[2][2] == "1,a\rb"
    assert reasons[3] == (2, None, None)


def test_nul_is_invalid_in_strings_and_escaped_in_raw_text(settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,name\n1,a\x00b\n2,\x00\n")
    rows = read(settings, CsvSource("t", {"id": "string", "name": "string"}))
    reason = "name: contains U+0000, which PostgreSQL text cannot store"
    assert by_line(rows, "id", "_reason", "_raw_text") == {
        2: (None, reason, "1,a\\x00b"),
        3: (None, reason, "2,\\x00"),
    }


def test_several_bad_columns_in_one_reason_capped(settings: Settings) -> None:
    put(settings, "t/a.csv", "a,b\nx,y\n")
    rows = read(settings, CsvSource("t", {"a": "int", "b": "date"}))
    assert by_line(rows, "_reason") == {
        2: ("a: not an integer; b: not a date (YYYY-MM-DD)",),
    }
    names = [f"column_{i:02d}" for i in range(30)]
    put(settings, "w/a.csv", ",".join(names) + "\n" + ",".join("x" * 30) + "\n")
    wide = read(settings, CsvSource("w", dict.fromkeys(names, "bigint")))
    reason = wide[0]["_reason"]
    assert len(reason) == 200 and reason.endswith("…")
    assert reason.startswith("column_00: not an integer; column_01: not an integer; ")
    assert wide[0]["_raw_text"] == ",".join("x" * 30)


# --- value rules ----------------------------------------------------------------------------

NOT_A_NUMBER = "v: not a number (nan and inf are not accepted)"
NOT_A_BOOLEAN = "v: not a boolean (true or false)"
NOT_A_DATE = "v: not a date (YYYY-MM-DD)"
NOT_A_TIMESTAMP = "v: not an RFC 3339 timestamp (YYYY-MM-DDTHH:MM:SS[.ffffff]Z or ±HH:MM)"
BIG = "9" * 38

# (declared type, the field's text, the value read, the record's reason): one rule per row.
VALUE_RULES: list[tuple[str, str, Any, str | None]] = [
    ("bigint", "42", 42, None),
    ("bigint", " -7\t", -7, None),  # spaces and tabs around are trimmed
    ("bigint", "+5", 5, None),
    ("bigint", "007", 7, None),
    ("bigint", "9223372036854775807", 2**63 - 1, None),
    ("bigint", "-9223372036854775808", -(2**63), None),
    ("bigint", "", None, None),  # empty → null
    ("bigint", "1.0", None, "v: not an integer"),
    ("bigint", "1e3", None, "v: not an integer"),
    ("bigint", "1_000", None, "v: not an integer"),
    ("bigint", "1 000", None, "v: not an integer"),
    ("bigint", "9223372036854775808", None, "v: out of range for bigint"),
    ("bigint", "abc", None, "v: not an integer"),
    ("bigint", "٣", None, "v: not an integer"),  # an Arabic-Indic digit is not ASCII
    ("bigint", "0x10", None, "v: not an integer"),
    # Far out of range (and past int()'s digit limit).
    ("bigint", "1" + "0" * 5000, None, "v: out of range for bigint"),
    ("int", "2147483647", 2**31 - 1, None),
    ("int", "-2147483648", -(2**31), None),
    ("int", "2147483648", None, "v: out of range for int"),
    ("int", "-2147483649", None, "v: out of range for int"),
    ("double", "1.5", 1.5, None),
    ("double", "-2e3", -2000.0, None),
    ("double", ".5", 0.5, None),
    ("double", "5.", 5.0, None),
    ("double", " 3 ", 3.0, None),
    ("double", "1E-2", 0.01, None),
    ("double", "nan", None, NOT_A_NUMBER),
    ("double", "inf", None, NOT_A_NUMBER),
    ("double", "-Infinity", None, NOT_A_NUMBER),
    ("double", "1e400", None, "v: out of range for double"),
    ("double", "1_0", None, NOT_A_NUMBER),
    ("double", "0x1p3", None, NOT_A_NUMBER),
    ("double", "1,5", None, NOT_A_NUMBER),
    ("boolean", "true", True, None),
    ("boolean", "FALSE", False, None),
    ("boolean", " True ", True, None),
    ("boolean", "1", None, NOT_A_BOOLEAN),
    ("boolean", "yes", None, NOT_A_BOOLEAN),
    ("boolean", "t", None, NOT_A_BOOLEAN),
    ("boolean", "truee", None, NOT_A_BOOLEAN),
    ("date", "2024-02-29", date(2024, 2, 29), None),
    ("date", "0001-01-01", date(1, 1, 1), None),
    ("date", "9999-12-31", date(9999, 12, 31), None),
    ("date", "2023-02-29", None, "v: not a valid calendar date"),
    ("date", "2024-1-01", None, NOT_A_DATE),
    ("date", "20240101", None, NOT_A_DATE),
    ("date", "2024-01-01T00:00:00Z", None, NOT_A_DATE),
    ("date", "2024-13-01", None, "v: not a valid calendar date"),
    ("timestamp", "2024-01-01T12:00:00Z", "2024-01-01 12:00:00", None),
    ("timestamp", "2024-01-01t12:00:00.5+02:00", "2024-01-01 10:00:00.5", None),
    ("timestamp", "2024-01-01 12:00:00-05:30", "2024-01-01 17:30:00", None),
    ("timestamp", "2024-01-01T00:00:00.123456z", "2024-01-01 00:00:00.123456", None),
    # Zeros past microseconds lose nothing.
    ("timestamp", "2024-01-01T00:00:00.123456000Z", "2024-01-01 00:00:00.123456", None),
    ("timestamp", "2024-01-01T00:00:00.1234567Z", None, "v: more precise than microseconds"),
    (
        "timestamp",
        "2024-01-01T12:00:00",  # naive
        None,
        "v: timestamp has no UTC offset (add Z or ±HH:MM)",
    ),
    ("timestamp", "2024-01-01T24:00:00Z", None, "v: not a valid time of day"),
    ("timestamp", "2024-06-30T23:59:60Z", None, "v: not a valid time of day"),  # leap second
    ("timestamp", "2024-02-30T00:00:00Z", None, "v: not a valid calendar date"),
    ("timestamp", "2024-01-01T00:00:00+24:00", None, "v: not a valid UTC offset"),
    # Before year 1 in UTC.
    ("timestamp", "0001-01-01T00:30:00+01:00", None, "v: outside the years 1-9999 in UTC"),
    ("timestamp", "2024-01-01", None, NOT_A_TIMESTAMP),
    ("timestamp", "2024-01-01T00:00Z", None, NOT_A_TIMESTAMP),
    ("decimal(5,2)", "123.45", Decimal("123.45"), None),
    ("decimal(5,2)", "-0.5", Decimal("-0.50"), None),
    ("decimal(5,2)", "1.500", Decimal("1.50"), None),  # trailing zeros lose nothing
    ("decimal(5,2)", "1e2", Decimal("100.00"), None),
    ("decimal(5,2)", "0.000", Decimal("0.00"), None),
    ("decimal(5,2)", "-0", Decimal("0.00"), None),
    ("decimal(5,2)", "1.234", None, "v: more than 2 digits after the point for decimal(5,2)"),
    ("decimal(5,2)", "1234.5", None, "v: too large for decimal(5,2)"),
    ("decimal(5,2)", "1.5E+3", None, "v: too large for decimal(5,2)"),
    ("decimal(5,2)", "nan", None, "v: not a decimal number"),
    ("decimal(5,2)", "1_0", None, "v: not a decimal number"),
    ("decimal(5,2)", "12.", Decimal("12.00"), None),
    ("decimal(38,0)", BIG, Decimal(BIG), None),
    ("decimal(38,0)", BIG + "9", None, "v: too large for decimal(38,0)"),
    ("decimal(38,0)", "0.5", None, "v: more than 0 digits after the point for decimal(38,0)"),
]


@pytest.mark.parametrize(
    ("ctype", "text", "value", "reason"),
    VALUE_RULES,
    ids=[f"{c}:{t[:30]!r}" for c, t, _, _ in VALUE_RULES],
)
def test_value_rule(settings: Settings, ctype: str, text: str, value: Any, reason: str) -> None:
    """One field of a header-less file, quoted (so a delimiter in it is data), read by the
    plain reader: the value, or null and the record's reason."""
    put(settings, "t/values.csv", f'"{text}"\n')
    rows = read(settings, CsvSource("t", {"v": ctype}, header=False))
    assert [(r["v"], r["_reason"]) for r in rows] == [(value, reason)]


def test_empty_fields_are_null_except_strings(settings: Settings) -> None:
    schema = {
        "s": "string",
        "b": "bigint",
        "i": "int",
        "d": "double",
        "o": "boolean",
        "t": "date",
        "ts": "timestamp",
        "m": "decimal(5,2)",
    }
    put(settings, "t/a.csv", "s,b,i,d,o,t,ts,m\n,,,,,,,\n  , ,\t, , , , , \n")
    rows = read(settings, CsvSource("t", schema))
    assert [[r[c] for c in ("_source_line", *schema, "_reason")] for r in rows] == [
        [2, "", None, None, None, None, None, None, None, None],
        # Strings are kept exactly; for other types spaces around a value are trimmed.
        [3, "  ", None, None, None, None, None, None, None, None],
    ]


def test_many_records_span_several_batches(settings: Settings) -> None:
    lines = ["id"] + [str(i) if i % 1000 else "bad" for i in range(1, 20001)]
    put(settings, "t/a.csv", "\n".join(lines) + "\n")
    source = CsvSource("t", {"id": "int"})
    rows = read(settings, source)
    ids = [r["id"] for r in rows if r["id"] is not None]
    assert {
        "n": len(rows),
        "bad": sum(r["_reason"] is not None for r in rows),
        "total": sum(ids),
        "first": min(r["_source_line"] for r in rows),
        "last": max(r["_source_line"] for r in rows),
    } == {
        "n": 20000,
        "bad": 20,
        "total": sum(range(1, 20001)) - sum(range(1000, 20001, 1000)),
        "first": 2,
        "last": 20001,
    }
    bad_lines = [r["_source_line"] for r in rows if r["_reason"] is not None]
    assert sorted(bad_lines) == [i + 1 for i in range(1000, 20001, 1000)]


# --- replay safety --------------------------------------------------------------------------


def test_missing_file_at_read_is_a_source_error(settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    put(settings, "t/b.csv", "id\n2\n")
    source = CsvSource("t", {"id": "int"})
    offsets = source.offsets(settings, source.discover(settings, None))
    (settings.landing.path / "t/b.csv").unlink()
    with pytest.raises(SourceError, match=re.escape("t/b.csv: missing")):
        source.read(None, settings, offsets)  # type: ignore[arg-type]  # checked before Spark


def test_changed_file_at_read_is_a_source_error(settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    source = CsvSource("t", {"id": "int"})
    offsets = source.offsets(settings, source.discover(settings, None))
    put(settings, "t/a.csv", "id\n1\n2\n")
    with pytest.raises(SourceError, match=re.escape("t/a.csv: size 7, expected 5")):
        source.read(None, settings, offsets)  # type: ignore[arg-type]  # checked before Spark


def test_same_offsets_read_the_same_rows(settings: Settings) -> None:
    put(settings, "t/a.csv", "id,name\n1,x\nbad,y\n")
    source = CsvSource("t", {"id": "int", "name": "string"})
    offsets = source.offsets(settings, source.discover(settings, None))
    put(settings, "t/b.csv", "id,name\n9,later\n")  # arrives after planning
    first = read(settings, source, offsets)
    second = read(settings, source, offsets)
    assert first == second
    assert [(r["_source_file"], r["_source_line"], r["id"]) for r in first] == [
        ("t/a.csv", 2, 1),
        ("t/a.csv", 3, None),
    ]


# -- required columns (no Spark: the executor's reader, called as a task calls it) -------------


def test_a_required_column_left_empty_is_invalid_never_an_empty_key(tmp_path: Path) -> None:
    source = CsvSource(
        "orders", schema={"order_id": "string", "note": "string", "n": "bigint"},
        required=("order_id", "n"),
    )  # fmt: skip
    path = tmp_path / "orders.csv"
    path.write_text(
        "order_id,note,n\n"
        "o1,,1\n"  # an empty field that is not required stays ""
        ",x,2\n"
        '"",x,3\n'
        " \t,x,4\n"
        "o5,x,\n"
        ",x,\n"
    )
    from onceflow.sources.csv import iter_csv_file

    batches = list(
        iter_csv_file(path, 0, "orders/orders.csv", source.schema, ",", True,
                      required=source.required)
    )  # fmt: skip
    rows = {r["_source_line"]: r for b in batches for r in b.to_pylist()}
    assert rows[2]["order_id"] == "o1" and rows[2]["note"] == "" and rows[2]["_reason"] is None
    for line in (3, 4, 5):
        assert rows[line]["_reason"] == "order_id: required, but empty", rows[line]
        assert rows[line]["order_id"] is None
    assert rows[5]["_raw_text"] == " \t,x,4"
    assert rows[6]["_reason"] == "n: required, but empty"
    assert rows[7]["_reason"] == "order_id: required, but empty; n: required, but empty"

    # Without `required`, the same file gives "" keys, as before.
    loose = CsvSource("orders", schema=source.schema)
    batches = list(iter_csv_file(path, 0, "orders/orders.csv", loose.schema, ",", True))
    assert [r["order_id"] for b in batches for r in b.to_pylist()][1] == ""

    with pytest.raises(ConfigurationError, match="required column 'id' is not in the schema"):
        CsvSource("orders", schema={"order_id": "string"}, required=("id",))


def test_raw_text_keeps_every_records_line(tmp_path: Path) -> None:
    from onceflow.sources.csv import iter_csv_file

    path = tmp_path / "orders.csv"
    path.write_text('order_id,n\no1,1\n"o,2",2\n')
    schema = CsvSource("orders", schema={"order_id": "string", "n": "bigint"}).schema
    kept = [
        r["_raw_text"]
        for b in iter_csv_file(path, 0, "o.csv", schema, ",", True, raw_text=True)
        for r in b.to_pylist()
    ]
    assert kept == ["o1,1", '"o,2",2']
    plain = [r["_raw_text"] for b in iter_csv_file(path, 0, "o.csv", schema, ",", True)
             for r in b.to_pylist()]  # fmt: skip
    assert plain == [None, None]
