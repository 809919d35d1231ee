"""Builds the Spark session onceflow runs on: local by default, any master or Spark Connect URL."""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Settings every onceflow session needs, whatever the cluster: timestamps kept in UTC and
# written as INT64 micros so Delta readers agree, and no _SUCCESS/.crc litter in table folders.
REQUIRED_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "spark.hadoop.parquet.enable.summary-metadata": "false",
}

# Spark skips its per-row Arrow batch sizing only for exactly this value (Int.MaxValue).
ARROW_NO_BYTE_LIMIT = 2**31 - 1

# Defaults sized for one small machine; a cluster's own settings override them.
LOCAL_DEFAULTS: dict[str, str] = {
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "2g",
    "spark.python.worker.reuse": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # A window is one small job over cached rows: adaptive execution would run each cached
    # relation as a query stage of its own and plan again after it, which costs more (about
    # 0.2 s a window, measured) than it could save on a machine this size.
    "spark.sql.adaptive.enabled": "false",
    # A window's cached rows live only while its sinks are written: compressing them cost
    # about a third of the write job's JVM time (0.3 → 0.2 s a 20,000-row window, measured)
    # to save memory held for a second.
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    # Batches to the Python workers bounded by rows only (maxRecordsPerBatch, 10,000), as
    # before Spark 4. Any other byte limit makes Spark size the Arrow batch after every row it
    # adds, walking each vector and each struct's children: about a third of a window's task
    # CPU, for the writers' tagged outputs (measured). A job whose rows are too wide for
    # 10,000 at a time sets `spark.sql.execution.arrow.maxRecordsPerBatch` lower.
    "spark.sql.execution.arrow.maxBytesPerBatch": str(ARROW_NO_BYTE_LIMIT),
}


# The JVM's JIT compiles a method once it has run 4 times as often as its defaults ask. A
# run's JVM is young, and Spark's planner (analysis, optimiser, tree rewrites) runs a few
# times a window: with the defaults, the JIT's threads took three times the CPU of the
# window's tasks (2 cores, measured). The code that runs hot (the tasks' loops) is still
# compiled.
JIT_JAVA_OPTIONS = "-XX:CompileThresholdScaling=4"


def defaults_for(master: str) -> dict[str, str]:
    """LOCAL_DEFAULTS for a session on `master`: `local[8]` runs 8 tasks at once, so its jobs
    are split for 8; a cluster's parallelism is its executors' cores (Spark's own default)."""
    settings = dict(LOCAL_DEFAULTS)
    cores = local_cores(master)
    if cores is None:
        del settings["spark.default.parallelism"]
    else:
        settings["spark.default.parallelism"] = str(cores)
    return settings


def local_cores(master: str) -> int | None:
    """The task slots of a `local`, `local[N]`, `local[*]` or `local[N, retries]` master; None
    for any other."""
    match = re.fullmatch(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?", master.strip())
    if match is None:
        return None
    slots = match.group(1)
    if slots is None:
        return 1
    return (os.cpu_count() or 1) if slots == "*" else max(1, int(slots))


def debug_enabled() -> bool:
    """`ONCEFLOW_DEBUG=1`: show Spark's own start-up and INFO logging."""
    return os.environ.get("ONCEFLOW_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def quiet_java_options() -> str:
    """JVM options that point Spark's log4j at onceflow's quiet profile (warnings and errors).

    Empty under `ONCEFLOW_DEBUG=1`, so Spark's INFO profile and its start-up chatter come back.
    """
    if debug_enabled():
        return ""
    profile = resources.files("onceflow") / "_spark_conf" / "log4j2-quiet.properties"
    return f"-Dlog4j2.configurationFile={Path(str(profile)).as_uri()}"


def java_options() -> str:
    """The JVM options of the Spark driver and executors onceflow starts: the JIT's thresholds
    (JIT_JAVA_OPTIONS) and the quiet logging profile (`quiet_java_options`)."""
    return " ".join(filter(None, [JIT_JAVA_OPTIONS, quiet_java_options()]))


# What the JVM itself prints at start, before any logging is set up, and nothing can turn off:
# Spark's launcher always adds the incubator module.
_JVM_NOTICES = (b"WARNING: Using incubator modules",)


# A log file past this size is moved aside (one old copy kept) when a session starts.
LOG_ROTATE_BYTES = 64 << 20


def _log_target(log_file: Path | None, stderr_fd: int) -> BinaryIO:
    """Where the JVM's stderr goes: `log_file`, else (or when it cannot be written) a copy
    of our stderr. The pump thread closes it."""
    if log_file is not None:
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            if log_file.is_file() and log_file.stat().st_size > LOG_ROTATE_BYTES:
                log_file.replace(log_file.with_name(log_file.name + ".1"))
            return open(log_file, "ab", buffering=0)
        except OSError:
            pass
    return os.fdopen(os.dup(stderr_fd), "wb", 0)


@contextmanager
def _jvm_notices_filtered(log_file: Path | None = None) -> Iterator[None]:
    """Start the JVM with its stderr through a pipe that drops `_JVM_NOTICES` and forwards
    everything else (warnings, errors, its Python workers' output) to our stderr, or to
    `log_file` when given."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to speak of: nothing to filter
        yield
        return
    target = _log_target(log_file, saved)
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as source, target:
            for line in source:
                if not line.startswith(_JVM_NOTICES):
                    target.write(line)

    threading.Thread(target=pump, name="onceflow-jvm-stderr", daemon=True).start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _quiet_python_logs() -> None:
    """PySpark logs each analysis error it raises, as JSON with the JVM's stack, through
    handlers of its own on stderr: the exception raised says what is wrong already."""
    from pyspark.logger import PySparkLogger

    for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger"):
        PySparkLogger.getLogger(name).disabled = True


def _quiet_client() -> None:
    # gRPC (the Spark Connect client) logs a notice on every fork of a process using it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def build_spark_session(
    master: str | None = None,
    remote: str | None = None,
    app_name: str = "onceflow",
    conf: Mapping[str, str] | None = None,
    log_file: Path | None = None,
) -> SparkSession:
    """Return a Spark session configured for onceflow.

    Unless `ONCEFLOW_DEBUG` is set, Spark's log (the JVM's warnings and errors, its Python
    workers' output) goes to `log_file` when one is given, else to stderr, and PySpark's own
    JSON logs of errors are off.

    Args:
        master: A `spark.master` URL; `local[2]` when neither this nor `remote` is given.
        remote: A Spark Connect URL (`sc://host:port`, see `onceflow spark-server`); takes
            precedence over `master`. The server holds the JVM, so the session starts in
            well under a second.
        app_name: The Spark application name.
        conf: Extra Spark settings, applied after the defaults.
        log_file: Where a local session's JVM writes its log (the command line gives
            `$ONCEFLOW_HOME/logs/spark.log`, so nothing of Spark's reaches the terminal).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    settings = dict(REQUIRED_CONF)
    if remote:
        _quiet_client()
        builder = builder.remote(remote)
    else:
        master = master or "local[2]"
        builder = builder.master(master)
        settings = {**defaults_for(master), **settings}
        settings["spark.driver.extraJavaOptions"] = java_options()
        settings["spark.executor.extraJavaOptions"] = java_options()
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if debug_enabled():
        return builder.getOrCreate()
    _quiet_python_logs()
    if remote:
        return builder.getOrCreate()
    with _jvm_notices_filtered(log_file):
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
