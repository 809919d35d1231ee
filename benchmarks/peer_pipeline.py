"""Benchmark peer: a plain Spark Structured Streaming job into Delta Lake and PostgreSQL."""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

INPUT_SCHEMA = (
    "payment_id STRING, merchant_id STRING, customer_id STRING, amount_cents LONG, "
    "currency STRING, created_at STRING"
)
COLUMNS = (
    "payment_id",
    "merchant_id",
    "customer_id",
    "amount_cents",
    "currency",
    "created_at",
    "_window_id",
    "_source_file",
    "_source_line",
)
TEXT_COLUMNS = ("payment_id", "merchant_id", "customer_id", "currency")
PAYMENTS_DDL = """
CREATE TABLE IF NOT EXISTS payments (
    payment_id text PRIMARY KEY, merchant_id text, customer_id text, amount_cents bigint,
    currency text, created_at timestamptz, _window_id bigint, _source_file text,
    _source_line bigint
)
"""
BALANCES_DDL = """
CREATE TABLE IF NOT EXISTS merchant_balances (
    merchant_id text, currency text, total_cents numeric, payment_count bigint,
    PRIMARY KEY (merchant_id, currency)
)
"""
INSERT_BALANCES = """
INSERT INTO merchant_balances (merchant_id, currency, total_cents, payment_count)
SELECT merchant_id, currency, sum(amount_cents), count(*) FROM tmp_payments
WHERE merchant_id IS NOT NULL AND currency IS NOT NULL  -- they form the primary key
GROUP BY 1, 2
ON CONFLICT (merchant_id, currency) DO UPDATE SET
    total_cents = merchant_balances.total_cents + EXCLUDED.total_cents,
    payment_count = merchant_balances.payment_count + EXCLUDED.payment_count
"""


@dataclass
class PeerResult:
    """What one run of the peer did."""

    seconds: float  # wall time from starting the query until all input is processed
    batches: int  # foreachBatch calls
    rows: int  # payments rows appended to Delta
    batch_latency: list[float] = field(default_factory=list)  # seconds per foreachBatch call


def create_tables(dsn: str) -> None:
    """Create the peer's `payments` and `merchant_balances` tables."""
    with psycopg.connect(dsn) as conn:
        conn.execute(PAYMENTS_DDL)
        conn.execute(BALANCES_DDL)


def write_postgres(dsn: str, table: Any) -> None:
    """COPY one batch into a temp table, then upsert payments and add it to the balances."""
    import pyarrow.csv as pacsv

    # Arrow writes the CSV in C++; a Python loop over rows would dominate the batch time.
    buffer = io.BytesIO()
    options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    pacsv.write_csv(table.select(list(COLUMNS)), buffer, options)
    columns = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE tmp_payments (LIKE payments) ON COMMIT DROP")
        copy_stmt = sql.SQL("COPY tmp_payments ({}) FROM STDIN (FORMAT csv)").format(columns)
        with cur.copy(copy_stmt) as copy:
            copy.write(buffer.getvalue())
        cur.execute(
            sql.SQL(
                "INSERT INTO payments ({cols}) SELECT {cols} FROM tmp_payments "
                "ON CONFLICT (payment_id) DO NOTHING"
            ).format(cols=columns)
        )
        cur.execute(INSERT_BALANCES)
        # Leaving the `with` block commits the transaction (and drops the temp table).


def run_peer(
    spark: Any,
    landing_dir: Path,
    lake_dir: Path,
    dsn: str,
    *,
    files_per_trigger: int,
    checkpoint_dir: Path,
) -> PeerResult:
    """Stream every `*.jsonl` file in `landing_dir` into Delta and PostgreSQL, at least once."""
    from deltalake import write_deltalake
    from pyspark.sql import functions as F

    create_tables(dsn)
    table_path = str(lake_dir / "payments")
    latencies: list[float] = []
    rows = 0

    raw = (
        spark.readStream.format("json")
        .schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", files_per_trigger)
        .option("pathGlobFilter", "*.jsonl")
        .load(str(landing_dir))
    )
    payments = (
        raw.where(F.col("payment_id").isNotNull())
        # try_: Spark 4 runs in ANSI mode, where to_timestamp fails the query on bad input.
        .withColumn("created_at", F.try_to_timestamp("created_at"))
        .withColumn("_source_file", F.col("_metadata.file_path"))
        # PostgreSQL text cannot hold NUL; one `\u0000` in the input would fail every COPY.
        .withColumns({c: F.translate(c, "\x00", "") for c in TEXT_COLUMNS})
    )

    def write_batch(batch_df: Any, batch_id: int) -> None:
        nonlocal rows
        started = time.perf_counter()
        batch = (
            batch_df.dropDuplicates(["payment_id"])
            .withColumn("_window_id", F.lit(batch_id).cast("long"))
            # A row id, not a line number: the JSON reader does not expose line numbers
            # (and streaming plans reject this expression, hence here on the batch).
            .withColumn("_source_line", F.monotonically_increasing_id())
        )
        table = batch.select(*COLUMNS).toArrow()
        if table.num_rows:
            write_deltalake(table_path, table, mode="append")
            write_postgres(dsn, table)
        rows += table.num_rows
        latencies.append(time.perf_counter() - started)

    query = (
        payments.writeStream.foreachBatch(write_batch)
        .option("checkpointLocation", str(checkpoint_dir))
        .trigger(availableNow=True)
    )
    started = time.perf_counter()
    handle = query.start()
    handle.awaitTermination()
    seconds = time.perf_counter() - started
    return PeerResult(seconds, len(latencies), rows, latencies)


def fresh_database(server_dsn: str, prefix: str) -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--files-per-trigger", type=int, default=1)
    args = parser.parse_args(argv)

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.generate import generate_payments
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-peer-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    server = pgserver.get_server(work / "pg", cleanup_mode="stop")
    spark = None
    try:
        dsn = fresh_database(server.get_uri(), "peer")
        landing = work / "landing"
        generate_payments(
            landing,
            records=args.records,
            files=args.files,
            duplicate_rate=0.05,
            invalid_rate=0.01,
            seed=1,
        )
        spark = build_spark_session(app_name="peer")
        result = run_peer(
            spark,
            landing / "payments",  # the generator writes into a sub-folder named after the job
            work / "lake",
            dsn,
            files_per_trigger=args.files_per_trigger,
            checkpoint_dir=work / "checkpoint",
        )
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT count(*) FROM payments").fetchone()
        pg_rows = row[0] if row else 0
        print(f"seconds: {result.seconds:.2f}")
        print(f"batches: {result.batches}")
        print(f"rows (Delta payments): {result.rows}")
        print(f"rows (PostgreSQL payments): {pg_rows}")
    finally:
        if spark is not None:
            spark.stop()
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
