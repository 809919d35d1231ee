"""CsvSource: typed CSV landing files on real Spark, with every rule of the contract checked."""

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
from onceflow.sources.csv import CsvSource

POSITION = ["_file_idx", "_source_file", "_source_line"]


@pytest.fixture()
def settings(tmp_path: Path, landing: Path) -> Settings:
    return Settings(home=tmp_path, postgres_dsn=None, lake=tmp_path / "lake", landing=landing)


def put(settings: Settings, rel: str, content: str | bytes) -> Path:
    path = settings.landing.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def read(spark, settings: Settings, source: CsvSource) -> list[dict[str, Any]]:
    """Every row of the source's current files as collected (partition = file order, then
    record order, which is the source order under test); timestamps as UTC strings."""
    offsets = source.offsets(settings, source.discover(settings, None))
    frame = source.read(spark, settings, offsets)
    columns = [
        f"CAST(`{f.name}` AS STRING) AS `{f.name}`"
        if f.dataType.typeName() == "timestamp"
        else f"`{f.name}`"
        for f in frame.schema.fields
    ]
    rows = frame.selectExpr(*columns).collect()
    return [row.asDict() for row in rows]


def by_line(rows: list[dict[str, Any]], *columns: str) -> dict[int, tuple[Any, ...]]:
    return {r["_source_line"]: tuple(r[c] for c in columns) for r in rows}


def one_column(settings: Settings, ctype: str, values: list[str]) -> CsvSource:
    """A header-less file with one `v` column, one value per line (line n holds values[n-1])."""
    put(settings, "t/values.csv", "".join(f"{v}\n" for v in values))
    return CsvSource("t", {"v": ctype}, header=False)


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


def test_frame_columns_types_and_values(spark, settings: Settings) -> None:
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
    assert read(spark, settings, source) == [
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


def test_files_in_name_order_and_ignored_names(spark, settings: Settings) -> None:
    for name in ("b.csv", "a.csv", "c.csv"):
        put(settings, f"pay/{name}", f"id\n{name[0]}1\n{name[0]}2\n")
    for ignored in (".hidden.csv", "_partial.csv", "x.csv.tmp", "notes.txt"):
        put(settings, f"pay/{ignored}", "id\nignored\n")
    (settings.landing.path / "pay" / "dir.csv").mkdir()
    put(settings, "other/z.csv", "id\nother\n")
    source = CsvSource("pay", {"id": "string"})
    assert source.discover(settings, None) == ["pay/a.csv", "pay/b.csv", "pay/c.csv"]
    rows = read(spark, settings, source)
    assert [(r["_file_idx"], r["_source_file"], r["_source_line"], r["id"]) for r in rows] == [
        (0, "pay/a.csv", 2, "a1"),
        (0, "pay/a.csv", 3, "a2"),
        (1, "pay/b.csv", 2, "b1"),
        (1, "pay/b.csv", 3, "b2"),
        (2, "pay/c.csv", 2, "c1"),
        (2, "pay/c.csv", 3, "c2"),
    ]


def test_line_numbers_blank_lines_and_multiline_quoted_fields(spark, settings: Settings) -> None:
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
    rows = read(spark, settings, CsvSource("t", {"id": "int", "note": "string"}))
    assert by_line(rows, "id", "note", "_reason") == {
        2: (1, "plain", None),
        5: (2, "first\n\nthird, with comma", None),
        8: (3, "last", None),
    }


def test_crlf_line_endings(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", b'id,note\r\n1,"a\r\nb"\r\n2,x\r\n3,bad,extra\r\n')
    rows = read(spark, settings, CsvSource("t", {"id": "int", "note": "string"}))
    assert by_line(rows, "id", "note", "_reason", "_raw_text") == {
        2: (1, "a\r\nb", None, None),
        4: (2, "x", None, None),
        5: (None, None, "expected 2 fields, got 3", "3,bad,extra"),
    }


def test_last_line_without_newline(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n2")
    rows = read(spark, settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "id") == {2: (1,), 3: (2,)}


def test_empty_file_and_header_only_file_give_no_rows(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "")
    put(settings, "t/b.csv", "id\n")
    put(settings, "t/c.csv", "id\n5\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int"}))
    assert [(r["_source_file"], r["_source_line"], r["id"]) for r in rows] == [("t/c.csv", 2, 5)]


def test_empty_window_reads_an_empty_frame(spark, settings: Settings) -> None:
    source = CsvSource("t", {"id": "int"})
    frame = source.read(spark, settings, source.offsets(settings, []))
    assert frame.columns == [*POSITION, "id", "_reason", "_raw_text"]
    assert frame.count() == 0


# --- header ---------------------------------------------------------------------------------


def test_header_matches_by_name_order_free_extras_ignored(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "extra, amount ,id\nzzz,1.50,7\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int", "amount": "decimal(5,2)"}))
    assert by_line(rows, "id", "amount", "_reason") == {2: (7, Decimal("1.50"), None)}


def test_header_with_byte_order_mark(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", b"\xef\xbb\xbfid,name\n1,x\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason") == {2: (1, "x", None)}


def test_header_lacking_columns_quarantines_the_file(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id,amount,currency\n1,2,EUR\n")
    put(settings, "t/b.csv", "id,amt\n1,2\n\n3,4\n")
    schema = {"id": "int", "amount": "int", "currency": "string"}
    rows = read(spark, settings, CsvSource("t", schema))
    reason = "header lacks columns amount, currency"
    assert [
        (r["_source_file"], r["_source_line"], r["id"], r["_reason"], r["_raw_text"]) for r in rows
    ] == [
        ("t/a.csv", 2, 1, None, None),
        ("t/b.csv", 1, None, reason, "id,amt"),
        ("t/b.csv", 2, None, reason, "1,2"),
        ("t/b.csv", 4, None, reason, "3,4"),
    ]


def test_header_lacking_one_column(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int", "amount": "int"}))
    assert by_line(rows, "_reason") == {
        1: ("header lacks column amount",),
        2: ("header lacks column amount",),
    }


def test_header_naming_a_column_twice_quarantines_the_file(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id,id,x\n1,2,3\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "_reason", "_raw_text") == {
        1: ("header names id more than once", "id,id,x"),
        2: ("header names id more than once", "1,2,3"),
    }


def test_no_header_takes_fields_in_schema_order(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id,amount\n1,2\n")
    rows = read(spark, settings, CsvSource("t", {"id": "string", "amount": "int"}, header=False))
    assert by_line(rows, "id", "amount", "_reason") == {
        1: (None, None, "amount: not an integer"),
        2: ("1", 2, None),
    }


def test_field_count_must_match(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "a,b,c\n1,2,3\n1,2\n1,2,3,4\n,,\n")
    rows = read(spark, settings, CsvSource("t", {"a": "int", "c": "int"}))
    assert by_line(rows, "a", "c", "_reason", "_raw_text") == {
        2: (1, 3, None, None),
        3: (None, None, "expected 3 fields, got 2", "1,2"),
        4: (None, None, "expected 3 fields, got 4", "1,2,3,4"),
        5: (None, None, None, None),
    }


def test_field_count_without_header(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "1\n1,2,3\n")
    rows = read(spark, settings, CsvSource("t", {"a": "int", "b": "int"}, header=False))
    assert by_line(rows, "_reason") == {
        1: ("expected 2 fields, got 1",),
        2: ("expected 2 fields, got 3",),
    }


def test_other_delimiters(spark, settings: Settings) -> None:
    put(settings, "semi/a.csv", 'id;name\n1;"a;b"\n2,5;x\n')
    put(settings, "tab/a.tsv", "id\tname\n1\ta,b\n")
    semi = read(spark, settings, CsvSource("semi", {"id": "int", "name": "string"}, delimiter=";"))
    assert by_line(semi, "id", "name", "_reason") == {
        2: (1, "a;b", None),
        3: (None, None, "id: not an integer"),
    }
    tab = CsvSource("tab", {"id": "int", "name": "string"}, suffix=".tsv", delimiter="\t")
    assert by_line(read(spark, settings, tab), "id", "name") == {2: (1, "a,b")}


# --- malformed input ------------------------------------------------------------------------


def test_invalid_utf8_quarantines_only_its_record(spark, settings: Settings) -> None:
    put(
        settings,
        "t/a.csv",
        b'id,name\n1,ok\n2,caf\xe9\n3,"multi\nline \xff"\n4,\xc3\xa9t\xc3\xa9\n',
    )
    rows = read(spark, settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason", "_raw_text") == {
        2: (1, "ok", None, None),
        3: (None, None, "invalid UTF-8", "2,caf\\xe9"),
        4: (None, None, "invalid UTF-8", '3,"multi\nline \\xff"'),
        6: (4, "été", None, None),
    }


def test_header_with_invalid_utf8_quarantines_the_file(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,n\xffame\n1,x\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int"}))
    assert by_line(rows, "_reason", "_raw_text") == {
        1: ("header: invalid UTF-8", "id,n\\xffame"),
        2: ("header: invalid UTF-8", "1,x"),
    }


def test_malformed_quoting_is_one_invalid_record(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", 'id,name\n1,"ab"c\n2,ok\n3,a"b\n')
    rows = read(spark, settings, CsvSource("t", {"id": "int", "name": "string"}))
    assert by_line(rows, "id", "name", "_reason", "_raw_text") == {
        2: (None, None, "malformed CSV: ',' expected after '\"'", '1,"ab"c'),
        3: (2, "ok", None, None),
        # A quote inside an unquoted field is a literal character (RFC 4180 leniency of csv).
        4: (3, 'a"b', None, None),
    }


UNTERMINATED = "unterminated quote on this line; the lines after it are read on their own"


def test_an_unterminated_quote_costs_only_its_line(spark, settings) -> None:
    # Open to the end of the file, and open until a later line's quote that cannot close it:
    # the valid records after the stray quote are delivered, never taken into its record.
    put(settings, "a/a.csv", 'id,name\n1,ok\n2,"open\n3,kept\n\n4,x\n')
    put(settings, "b/b.csv", 'id,name\n5,"open\n"6",kept\n7,x\n')
    schema = {"id": "int", "name": "string"}
    assert by_line(read(spark, settings, CsvSource("a", schema)), "id", "_reason", "_raw_text") == {
        2: (1, None, None),
        3: (None, f"malformed CSV: unexpected end of data ({UNTERMINATED})", '2,"open'),
        4: (3, None, None),
        6: (4, None, None),
    }
    assert by_line(read(spark, settings, CsvSource("b", schema)), "id", "_reason", "_raw_text") == {
        2: (None, f"malformed CSV: ',' expected after '\"' ({UNTERMINATED})", '5,"open'),
        3: (6, None, None),
        4: (7, None, None),
    }


def test_stray_carriage_return_is_malformed(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,name\n1,a\rb\n2,ok\n")
    rows = read(spark, settings, CsvSource("t", {"id": "int", "name": "string"}))
    reasons = by_line(rows, "id", "_reason", "_raw_text")
    assert reasons[2][0] is None
    assert reasons[2][1].startswith("malformed CSV: new-line character seen in unquoted field")
    assert reasons[2][2] == "1,a\rb"
    assert reasons[3] == (2, None, None)


def test_nul_is_invalid_in_strings_and_escaped_in_raw_text(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", b"id,name\n1,a\x00b\n2,\x00\n")
    rows = read(spark, settings, CsvSource("t", {"id": "string", "name": "string"}))
    reason = "name: contains U+0000, which PostgreSQL text cannot store"
    assert by_line(rows, "id", "_reason", "_raw_text") == {
        2: (None, reason, "1,a\\x00b"),
        3: (None, reason, "2,\\x00"),
    }


def test_several_bad_columns_in_one_reason_capped(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "a,b\nx,y\n")
    rows = read(spark, settings, CsvSource("t", {"a": "int", "b": "date"}))
    assert by_line(rows, "_reason") == {
        2: ("a: not an integer; b: not a date (YYYY-MM-DD)",),
    }
    names = [f"column_{i:02d}" for i in range(30)]
    put(settings, "w/a.csv", ",".join(names) + "\n" + ",".join("x" * 30) + "\n")
    wide = read(spark, settings, CsvSource("w", dict.fromkeys(names, "bigint")))
    reason = wide[0]["_reason"]
    assert len(reason) == 200 and reason.endswith("…")
    assert reason.startswith("column_00: not an integer; column_01: not an integer; ")
    assert wide[0]["_raw_text"] == ",".join("x" * 30)


# --- value rules ----------------------------------------------------------------------------


def test_integer_rules(spark, settings: Settings) -> None:
    values = [
        "42",  # 1
        " -7\t",  # 2: spaces and tabs around are trimmed
        "+5",  # 3
        "007",  # 4
        "9223372036854775807",  # 5
        "-9223372036854775808",  # 6
        '""',  # 7: empty → null
        "1.0",  # 8
        "1e3",  # 9
        "1_000",  # 10
        "1 000",  # 11
        "9223372036854775808",  # 12
        "abc",  # 13
        "٣",  # 14: an Arabic-Indic digit is not ASCII
        "0x10",  # 15
        "1" + "0" * 5000,  # 16: far out of range (and past int()'s digit limit)
    ]
    rows = read(spark, settings, one_column(settings, "bigint", values))
    assert by_line(rows, "v", "_reason") == {
        1: (42, None),
        2: (-7, None),
        3: (5, None),
        4: (7, None),
        5: (2**63 - 1, None),
        6: (-(2**63), None),
        7: (None, None),
        8: (None, "v: not an integer"),
        9: (None, "v: not an integer"),
        10: (None, "v: not an integer"),
        11: (None, "v: not an integer"),
        12: (None, "v: out of range for bigint"),
        13: (None, "v: not an integer"),
        14: (None, "v: not an integer"),
        15: (None, "v: not an integer"),
        16: (None, "v: out of range for bigint"),
    }


def test_int_range(spark, settings: Settings) -> None:
    values = ["2147483647", "-2147483648", "2147483648", "-2147483649"]
    rows = read(spark, settings, one_column(settings, "int", values))
    assert by_line(rows, "v", "_reason") == {
        1: (2**31 - 1, None),
        2: (-(2**31), None),
        3: (None, "v: out of range for int"),
        4: (None, "v: out of range for int"),
    }


def test_double_rules(spark, settings: Settings) -> None:
    values = [
        "1.5",
        "-2e3",
        ".5",
        "5.",
        " 3 ",
        "1E-2",
        "nan",
        "inf",
        "-Infinity",
        "1e400",
        "1_0",
        "0x1p3",
        "1,5",
    ]
    put(settings, "t/values.csv", "".join(f'"{v}"\n' for v in values))
    rows = read(spark, settings, CsvSource("t", {"v": "double"}, header=False))
    not_a_number = "v: not a number (nan and inf are not accepted)"
    assert by_line(rows, "v", "_reason") == {
        1: (1.5, None),
        2: (-2000.0, None),
        3: (0.5, None),
        4: (5.0, None),
        5: (3.0, None),
        6: (0.01, None),
        7: (None, not_a_number),
        8: (None, not_a_number),
        9: (None, not_a_number),
        10: (None, "v: out of range for double"),
        11: (None, not_a_number),
        12: (None, not_a_number),
        13: (None, not_a_number),
    }


def test_boolean_rules(spark, settings: Settings) -> None:
    values = ["true", "FALSE", " True ", "1", "yes", "t", "truee"]
    rows = read(spark, settings, one_column(settings, "boolean", values))
    bad = "v: not a boolean (true or false)"
    assert by_line(rows, "v", "_reason") == {
        1: (True, None),
        2: (False, None),
        3: (True, None),
        4: (None, bad),
        5: (None, bad),
        6: (None, bad),
        7: (None, bad),
    }


def test_date_rules(spark, settings: Settings) -> None:
    values = [
        "2024-02-29",
        "0001-01-01",
        "9999-12-31",
        "2023-02-29",
        "2024-1-01",
        "20240101",
        "2024-01-01T00:00:00Z",
        "2024-13-01",
    ]
    rows = read(spark, settings, one_column(settings, "date", values))
    shape = "v: not a date (YYYY-MM-DD)"
    assert by_line(rows, "v", "_reason") == {
        1: (date(2024, 2, 29), None),
        2: (date(1, 1, 1), None),
        3: (date(9999, 12, 31), None),
        4: (None, "v: not a valid calendar date"),
        5: (None, shape),
        6: (None, shape),
        7: (None, shape),
        8: (None, "v: not a valid calendar date"),
    }


def test_timestamp_rules(spark, settings: Settings) -> None:
    values = [
        "2024-01-01T12:00:00Z",  # 1
        "2024-01-01t12:00:00.5+02:00",  # 2
        "2024-01-01 12:00:00-05:30",  # 3
        "2024-01-01T00:00:00.123456z",  # 4
        "2024-01-01T00:00:00.123456000Z",  # 5: zeros past microseconds lose nothing
        "2024-01-01T00:00:00.1234567Z",  # 6
        "2024-01-01T12:00:00",  # 7: naive
        "2024-01-01T24:00:00Z",  # 8
        "2024-06-30T23:59:60Z",  # 9: leap second
        "2024-02-30T00:00:00Z",  # 10
        "2024-01-01T00:00:00+24:00",  # 11
        "0001-01-01T00:30:00+01:00",  # 12: before year 1 in UTC
        "2024-01-01",  # 13
        "2024-01-01T00:00Z",  # 14
    ]
    rows = read(spark, settings, one_column(settings, "timestamp", values))
    shape = "v: not an RFC 3339 timestamp (YYYY-MM-DDTHH:MM:SS[.ffffff]Z or ±HH:MM)"
    assert by_line(rows, "v", "_reason") == {
        1: ("2024-01-01 12:00:00", None),
        2: ("2024-01-01 10:00:00.5", None),
        3: ("2024-01-01 17:30:00", None),
        4: ("2024-01-01 00:00:00.123456", None),
        5: ("2024-01-01 00:00:00.123456", None),
        6: (None, "v: more precise than microseconds"),
        7: (None, "v: timestamp has no UTC offset (add Z or ±HH:MM)"),
        8: (None, "v: not a valid time of day"),
        9: (None, "v: not a valid time of day"),
        10: (None, "v: not a valid calendar date"),
        11: (None, "v: not a valid UTC offset"),
        12: (None, "v: outside the years 1-9999 in UTC"),
        13: (None, shape),
        14: (None, shape),
    }


def test_decimal_rules(spark, settings: Settings) -> None:
    values = [
        "123.45",  # 1
        "-0.5",  # 2
        "1.500",  # 3: trailing zeros lose nothing
        "1e2",  # 4
        "0.000",  # 5
        "-0",  # 6
        "1.234",  # 7
        "1234.5",  # 8
        "1.5E+3",  # 9
        "nan",  # 10
        "1_0",  # 11
        "",  # 12: an empty line is no record; see test_empty_fields_are_null
        "12.",  # 13
    ]
    rows = read(spark, settings, one_column(settings, "decimal(5,2)", values))
    assert by_line(rows, "v", "_reason") == {
        1: (Decimal("123.45"), None),
        2: (Decimal("-0.50"), None),
        3: (Decimal("1.50"), None),
        4: (Decimal("100.00"), None),
        5: (Decimal("0.00"), None),
        6: (Decimal("0.00"), None),
        7: (None, "v: more than 2 digits after the point for decimal(5,2)"),
        8: (None, "v: too large for decimal(5,2)"),
        9: (None, "v: too large for decimal(5,2)"),
        10: (None, "v: not a decimal number"),
        11: (None, "v: not a decimal number"),
        13: (Decimal("12.00"), None),
    }


def test_decimal_precision_38(spark, settings: Settings) -> None:
    big = "9" * 38
    rows = read(spark, settings, one_column(settings, "decimal(38,0)", [big, big + "9", "0.5"]))
    assert by_line(rows, "v", "_reason") == {
        1: (Decimal(big), None),
        2: (None, "v: too large for decimal(38,0)"),
        3: (None, "v: more than 0 digits after the point for decimal(38,0)"),
    }


def test_empty_fields_are_null_except_strings(spark, settings: Settings) -> None:
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
    rows = read(spark, settings, CsvSource("t", schema))
    assert [[r[c] for c in ("_source_line", *schema, "_reason")] for r in rows] == [
        [2, "", None, None, None, None, None, None, None, None],
        # Strings are kept exactly; for other types spaces around a value are trimmed.
        [3, "  ", None, None, None, None, None, None, None, None],
    ]


def test_many_records_span_several_batches(spark, settings: Settings) -> None:
    lines = ["id"] + [str(i) if i % 1000 else "bad" for i in range(1, 20001)]
    put(settings, "t/a.csv", "\n".join(lines) + "\n")
    source = CsvSource("t", {"id": "int"})
    frame = source.read(spark, settings, source.offsets(settings, source.discover(settings, None)))
    stats = frame.selectExpr(
        "count(*) AS n",
        "count(_reason) AS bad",
        "sum(id) AS total",
        "min(_source_line) AS first",
        "max(_source_line) AS last",
    ).first()
    assert stats.asDict() == {
        "n": 20000,
        "bad": 20,
        "total": sum(range(1, 20001)) - sum(range(1000, 20001, 1000)),
        "first": 2,
        "last": 20001,
    }
    bad_lines = [r[0] for r in frame.where("_reason IS NOT NULL").select("_source_line").collect()]
    assert sorted(bad_lines) == [i + 1 for i in range(1000, 20001, 1000)]


# --- replay safety --------------------------------------------------------------------------


def test_missing_file_at_read_is_a_source_error(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    put(settings, "t/b.csv", "id\n2\n")
    source = CsvSource("t", {"id": "int"})
    offsets = source.offsets(settings, source.discover(settings, None))
    (settings.landing.path / "t/b.csv").unlink()
    with pytest.raises(SourceError, match=re.escape("t/b.csv: missing")):
        source.read(spark, settings, offsets)


def test_changed_file_at_read_is_a_source_error(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id\n1\n")
    source = CsvSource("t", {"id": "int"})
    offsets = source.offsets(settings, source.discover(settings, None))
    put(settings, "t/a.csv", "id\n1\n2\n")
    with pytest.raises(SourceError, match=re.escape("t/a.csv: size 7, expected 5")):
        source.read(spark, settings, offsets)


def test_same_offsets_read_the_same_rows(spark, settings: Settings) -> None:
    put(settings, "t/a.csv", "id,name\n1,x\nbad,y\n")
    source = CsvSource("t", {"id": "int", "name": "string"})
    offsets = source.offsets(settings, source.discover(settings, None))
    put(settings, "t/b.csv", "id,name\n9,later\n")  # arrives after planning
    first = [r.asDict() for r in source.read(spark, settings, offsets).collect()]
    second = [r.asDict() for r in source.read(spark, settings, offsets).collect()]
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
