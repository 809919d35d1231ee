"""A job's own mistakes found when it loads, or at its first window's plan, never in Java.

Through the real `onceflow` command where a user meets them: the README's `orders` job
(tests/support/user_project) and variants of it written next to it. A mismatch between the
job's declarations (sinks, outputs, columns, keys, quarantine) is refused when the module is
imported, before Spark starts; a sink column the transform's output lacks is named at the
window's plan from the output's schema, before anything is written, and the job runs once it
is fixed. Typed sources refuse empty required columns, a `parse` on a typed source keeps each
rejected record's line, and sink columns take the source's types.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import CsvSource, Dedupe, DeltaSink, Job, PostgresSink, quarantine_table
from onceflow.errors import ConfigurationError
from tests.core.test_user_mistakes import _env, onceflow
from tests.support.orders_data import (
    JOB,
    USER_PROJECT,
    assert_orders_exact,
    one_file_per_window,
    write_orders,
)

MODULE = "orders_jobs"


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(USER_PROJECT / f"{MODULE}.py", folder)
    return folder


# -- when the job loads (no Spark) -------------------------------------------------------------

NO_QUARANTINE_SINK = """
import dataclasses
from orders_jobs import ORDERS

ORDERS = dataclasses.replace(ORDERS, quarantine_sink=None)
"""


def test_a_quarantine_table_without_quarantine_sink_is_refused_before_spark_starts(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    (project / "no_quarantine_sink.py").write_text(NO_QUARANTINE_SINK)
    home = tmp_path / "home"
    env = _env(home, pg_dsn, lake, landing, ONCEFLOW_JOBS="no_quarantine_sink")
    write_orders(landing)
    # Before: it loaded, Spark started, and window 1 failed with "the transform gave no
    # output named ['quarantine']".
    run = onceflow(["run", JOB], env, project, rc=1)
    last = run.stderr.strip().splitlines()[-1]
    assert "job orders: sink orders_quarantine is a quarantine table" in last, run.stderr
    assert "add quarantine_sink='orders_quarantine' to the Job" in last
    assert "Traceback" not in run.stderr
    assert not (home / "logs" / "spark.log").exists()  # Spark never started
    listed = onceflow(["jobs"], env, project, rc=1)
    assert "is a quarantine table" in listed.stderr


def _src() -> CsvSource:
    return CsvSource("in", schema={"id": "string", "n": "bigint", "at": "timestamp"})


def _pg(name: str = "pg_out", output: str = "out", **kw: Any) -> PostgresSink:
    args: dict[str, Any] = {"table": "out", "columns": {"id": "text", "n": "bigint"}}
    args.update(kw)
    return PostgresSink(name, output, **args)


def _t(rows: Any, ctx: Any) -> dict[str, Any]:
    return {"out": rows}


def test_declared_outputs_and_the_sinks_must_agree() -> None:
    Job(name="j", source=_src(), transform=_t, sinks=(_pg(),), outputs=("out",))
    with pytest.raises(
        ConfigurationError,
        match=r"job j: sink pg_out takes output 'totals', which the transform does not declare "
        r"\(outputs=\['out'\]\)",
    ):
        Job(name="j", source=_src(), transform=_t, sinks=(_pg(output="totals"),),
            outputs=("out",))  # fmt: skip
    with pytest.raises(ConfigurationError, match="job j: output 'extra' goes to no sink"):
        Job(name="j", source=_src(), transform=_t, sinks=(_pg(),), outputs=("out", "extra"))
    # The quarantine output is onceflow's, not the transform's: it need not be declared.
    Job(name="j", source=_src(), transform=_t, sinks=(_pg(), quarantine_table("q_out")),
        quarantine_sink="q_out", outputs=("out",))  # fmt: skip


def test_the_quarantine_sink_and_the_quarantine_table_must_agree() -> None:
    with pytest.raises(ConfigurationError, match="job j: sink q_out is a quarantine table"):
        Job(name="j", source=_src(), transform=_t, sinks=(_pg(), quarantine_table("q_out")))
    with pytest.raises(ConfigurationError, match="a job has one quarantine sink"):
        Job(name="j", source=_src(), transform=_t,
            sinks=(_pg(), quarantine_table("q1"), quarantine_table("q2", output="q")),
            quarantine_sink="q1")  # fmt: skip
    with pytest.raises(
        ConfigurationError,
        match=r"job j: sink pg_out is the job's quarantine_sink, .* it declares column id, "
        r"which they do not have",
    ):
        Job(name="j", source=_src(), transform=_t, sinks=(_pg(),), quarantine_sink="pg_out")


def test_a_dedupe_key_must_be_a_source_column() -> None:
    lake = DeltaSink("lake_out", "out", table="out")
    with pytest.raises(
        ConfigurationError, match=r"job j: dedupe key column order_id is not a column of the source"
    ):
        Job(name="j", source=_src(), transform=_t, sinks=(lake,),
            dedupe=Dedupe(key=("order_id",), state_sink="lake_out"))  # fmt: skip
    # With a parse, the parsed columns are not known before the plan.
    Job(name="j", source=_src(), parse=lambda df: df, transform=_t, sinks=(lake,),
        dedupe=Dedupe(key=("order_id",), state_sink="lake_out"))  # fmt: skip


def test_sink_columns_in_the_source_vocabulary_or_typed_by_the_source() -> None:
    # Source types are sink types too.
    sink = _pg(columns={"id": "string", "at": "timestamp", "amount": "decimal(12,2)",
                        "n": "int", "x": "double", "ok": "BOOLEAN"})  # fmt: skip
    assert sink.columns == {
        "id": "text", "at": "timestamptz", "amount": "numeric", "n": "integer",
        "x": "double precision", "ok": "boolean",
    }  # fmt: skip
    # Columns named without a type take the source column's when the job loads.
    job = Job(name="j", source=_src(), transform=_t,
              sinks=(_pg(columns=["id", "at", ("window_id", "bigint")]),))  # fmt: skip
    assert job.sinks[0].declared_columns() == (
        ("id", "text"), ("at", "timestamptz"), ("window_id", "bigint"),
    )  # fmt: skip
    assert job.sink("pg_out").columns == {"id": "text", "at": "timestamptz", "window_id": "bigint"}
    mapped = Job(name="j", source=_src(), transform=_t,
                 sinks=(_pg(columns={"id": None, "n": "bigint"}),))  # fmt: skip
    assert mapped.sinks[0].columns == {"id": "text", "n": "bigint"}
    with pytest.raises(
        ConfigurationError,
        match="job j: sink pg_out: column window_id is given without a type, so it takes the "
        "source column's, but the source declares",
    ):
        Job(name="j", source=_src(), transform=_t, sinks=(_pg(columns=["id", "window_id"]),))
    with pytest.raises(ConfigurationError, match="column id has type 'varchar'; use one of"):
        _pg(columns={"id": "varchar"})


# -- at the first window's plan (real Spark, through the CLI) ----------------------------------

EXTRA_COLUMN = """
import dataclasses
from onceflow import PostgresSink
from orders_jobs import ORDERS

pg, quarantine = ORDERS.sinks
ORDERS = dataclasses.replace(
    ORDERS,
    sinks=(dataclasses.replace(pg, columns={**pg.columns, "channel": "text"}), quarantine),
)
"""


def _rows(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # fixed names
    assert row is not None
    return int(row[0])


def test_a_sink_column_missing_from_the_output_is_named_before_any_write(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    (project / "extra_column.py").write_text(EXTRA_COLUMN)
    home = tmp_path / "home"
    env = _env(home, pg_dsn, lake, landing, ONCEFLOW_JOBS="extra_column")
    write_orders(landing)
    # Before: "window 1: writing its rows failed on an executor (AnalysisException); nothing
    # was committed. Run the job again." with the column only inside a Java stack trace.
    run = onceflow(["run", JOB, "--max-files-per-window", "1"], env, project, rc=1)
    last = run.stderr.strip().splitlines()[-1]
    assert (
        "job orders: sink pg_orders declares column channel, but the transform's output "
        "'orders' has no column channel" in last
    ), run.stderr
    assert "or take it out of the sink's columns" in last
    assert "Run the job again" not in run.stderr and "AnalysisException" not in run.stderr
    assert _rows(pg_dsn, "public.orders") == 0
    assert _rows(pg_dsn, "onceflow.quarantine") == 0
    # Nothing staged by the code that failed: the fixed job computes window 1 afresh.
    assert not list(lake.rglob("_COMPLETE*"))

    # The user fixes the job (the column out of the sink): every window once.
    fixed = onceflow(["run", JOB, "--max-files-per-window", "1"], {**env, "ONCEFLOW_JOBS": MODULE},
                     project)  # fmt: skip
    assert "3 window(s)" in fixed.stdout, fixed.stdout
    assert_orders_exact(pg_dsn, one_file_per_window())


CHECKED = """
from pyspark.sql import functions as F

from onceflow import CsvSource, Job, PostgresSink, quarantine_table


def refuse_negative(rows):
    negative = F.col("_reason").isNull() & (F.col("amount_cents") < 0)
    return rows.withColumn(
        "_reason", F.when(negative, F.lit("amount_cents: negative")).otherwise(F.col("_reason"))
    )


def orders(rows, ctx):
    return {"orders": rows.select("order_id", "customer", "amount_cents", "ordered_at",
                                  ctx.window_id_column().alias("window_id"))}


CHECKED = Job(
    name="checked",
    source=CsvSource(
        "checked",
        schema={"order_id": "string", "customer": "string", "amount_cents": "bigint",
                "ordered_at": "timestamp"},
        required=("order_id",),
    ),
    parse=refuse_negative,
    transform=orders,
    sinks=(
        PostgresSink("pg_checked", "orders", table="checked",
                     columns=["order_id", "customer", "amount_cents", "ordered_at",
                              ("window_id", "bigint")],
                     key=("order_id",), mode="upsert", window_column="window_id"),
        quarantine_table("checked_quarantine"),
    ),
    quarantine_sink="checked_quarantine",
    outputs=("orders",),
)
"""

CHECKED_LINES = [
    "order_id,customer,amount_cents,ordered_at",
    "o1,Alice,100,2024-05-01T10:00:00Z",
    ",Bob,200,2024-05-01T10:00:00Z",
    "o3,Carol,-5,2024-05-01T10:00:00Z",
    " ,Dan,300,2024-05-01T10:00:00Z",
    "o5,,400,2024-05-01T10:00:00Z",
]


def test_required_columns_a_parse_on_a_typed_source_and_columns_typed_by_the_source(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, project: Path
) -> None:
    (project / "checked_jobs.py").write_text(CHECKED)
    env = _env(tmp_path / "home", pg_dsn, lake, landing, ONCEFLOW_JOBS="checked_jobs")
    (landing / "checked").mkdir(parents=True)
    (landing / "checked" / "c-001.csv").write_text("".join(f"{x}\n" for x in CHECKED_LINES))
    run = onceflow(["run", "checked"], env, project)
    assert "1 window(s)" in run.stdout, run.stdout
    with psycopg.connect(pg_dsn) as conn:
        delivered = conn.execute(
            "SELECT order_id, customer, amount_cents, window_id FROM public.checked"
            " ORDER BY order_id"
        ).fetchall()
        types = dict(
            conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns"
                " WHERE table_schema = 'public' AND table_name = 'checked'"
            ).fetchall()
        )
        quarantined = conn.execute(
            "SELECT source_line, raw_line, reason FROM onceflow.quarantine WHERE job = 'checked'"
            " ORDER BY source_line"
        ).fetchall()
    # An empty key is quarantined, never delivered as ""; an empty customer is a valid "".
    assert delivered == [("o1", "Alice", 100, 1), ("o5", "", 400, 1)]
    assert types == {
        "order_id": "text", "customer": "text", "amount_cents": "bigint",
        "ordered_at": "timestamp with time zone", "window_id": "bigint",
    }  # fmt: skip
    # Every rejected record keeps its line: those the source refused and the one the parse did
    # (before: the parse's rejects had an empty raw_line).
    assert quarantined == [
        (3, CHECKED_LINES[2], "order_id: required, but empty"),
        (4, CHECKED_LINES[3], "amount_cents: negative"),
        (5, CHECKED_LINES[4], "order_id: required, but empty"),
    ]
