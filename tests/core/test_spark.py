"""The session onceflow builds: Spark's start-up chatter stays out of a user's terminal."""

from __future__ import annotations

import os
from pathlib import Path

from onceflow.generate import generate_payments
from onceflow.spark import (
    ARROW_NO_BYTE_LIMIT,
    JIT_JAVA_OPTIONS,
    defaults_for,
    java_options,
    local_cores,
    quiet_java_options,
)
from tests.support.cli import CliRun

CHATTER = (
    "Using Spark's default log4j profile",
    'Setting default log level to "WARN"',
    "NativeCodeLoader",
    "resolves to a loopback address",
    " INFO ",
    "Using incubator modules",
)


def test_a_local_run_prints_its_windows_and_no_spark_chatter(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    generate_payments(landing, records=200, files=1, seed=5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env.update(
        ONCEFLOW_HOME=str(tmp_path / "home"),
        ONCEFLOW_POSTGRES_DSN=pg_dsn,
        ONCEFLOW_LAKE=str(lake),
        ONCEFLOW_LANDING=str(landing),
    )
    done = CliRun(["run", "payments"], env, tmp_path / "logs").finish()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "window 1: 1 file(s), 200 records" in done.stdout
    shown = [line for line in done.stderr.splitlines() if any(c in line for c in CHATTER)]
    assert not shown, shown


def test_debug_restores_sparks_own_logging(monkeypatch) -> None:
    assert "log4j2-quiet.properties" in quiet_java_options()
    assert Path(quiet_java_options().split("=", 1)[1].removeprefix("file://")).is_file()
    monkeypatch.setenv("ONCEFLOW_DEBUG", "1")
    assert quiet_java_options() == ""


def test_the_jvm_runs_with_the_jit_thresholds_and_quiet_logging(spark) -> None:
    runtime = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    arguments = list(runtime.getInputArguments())
    assert JIT_JAVA_OPTIONS in arguments
    assert any("log4j2-quiet.properties" in a for a in arguments)


def test_debug_keeps_the_jit_thresholds(monkeypatch) -> None:
    monkeypatch.setenv("ONCEFLOW_DEBUG", "1")
    assert java_options() == JIT_JAVA_OPTIONS


def test_python_batches_are_bounded_by_rows_not_sized_after_every_row(spark) -> None:
    # Any byte limit but ARROW_NO_BYTE_LIMIT makes Spark size the batch after each row.
    limit = spark.conf.get("spark.sql.execution.arrow.maxBytesPerBatch")
    assert int(limit.rstrip("b")) == ARROW_NO_BYTE_LIMIT
    rows = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch"))

    def sizes(batches):
        import pyarrow as pa

        for batch in batches:
            yield pa.RecordBatch.from_pydict({"n": [batch.num_rows]})

    frame = spark.range(0, 2 * rows + 5, numPartitions=1).selectExpr(
        "struct(id, cast(id AS string) AS text) AS s"
    )
    seen = sorted(r["n"] for r in frame.mapInArrow(sizes, "n BIGINT").collect())
    assert seen == [5, rows, rows]


def test_a_local_masters_task_slots_are_its_parallelism(spark) -> None:
    assert spark.conf.get("spark.default.parallelism") == "2"  # the default, local[2]
    assert [local_cores(m) for m in ("local", "local[4]", "local[ 8 , 3]", "local[*]")] == [
        1,
        4,
        8,
        os.cpu_count(),
    ]
    assert local_cores("spark://host:7077") is None
    assert local_cores("local-cluster[2, 1, 1024]") is None
    assert defaults_for("local[4]")["spark.default.parallelism"] == "4"
    # A cluster's is Spark's own: its executors' cores.
    assert "spark.default.parallelism" not in defaults_for("spark://host:7077")
