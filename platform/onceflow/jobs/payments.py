"""The reference job `payments`: JSON-lines payments into Delta and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from onceflow.job import Dedupe, Job, WindowContext
from onceflow.jobs._payments_fast import parse_canonical
from onceflow.jobs._payments_rules import Invalid, Payment, parse_payment_line
from onceflow.sinks.delta import DeltaSink
from onceflow.sinks.postgres import PostgresSink, quarantine_table
from onceflow.sources.base import ArrowParse
from onceflow.sources.landing import LandingSource

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

PARSED_SCHEMA = (
    "_file_idx INT, _source_file STRING, _source_line BIGINT, payment_id STRING, "
    "merchant_id STRING, customer_id STRING, amount_cents BIGINT, currency STRING, "
    "created_at TIMESTAMP, _raw_text STRING, _reason STRING"
)

PAYMENT_COLUMNS = {
    "payment_id": "text",
    "merchant_id": "text",
    "customer_id": "text",
    "amount_cents": "bigint",
    "currency": "text",
    "created_at": "timestamptz",
    "_window_id": "bigint",
    "_source_file": "text",
    "_source_line": "bigint",
}


def _raw_text(raw: bytes) -> str:
    # PostgreSQL text cannot hold NUL; keep everything else as it came.
    return raw.decode("utf-8", errors="backslashreplace").replace("\x00", "\\x00")


_FIELDS = ("payment_id", "merchant_id", "customer_id", "amount_cents", "currency", "created_at")


def _parse_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa
    import pyarrow.compute as pc

    for batch in batches:
        raw = batch.column("_raw")
        fast, values = parse_canonical(raw)
        parsed = pa.RecordBatch.from_arrays(
            [
                *(
                    batch.column(c).filter(fast)
                    for c in ("_file_idx", "_source_file", "_source_line")
                ),
                *(values[name] for name in _FIELDS),
                pa.nulls(len(values["payment_id"]), pa.string()),
                pa.nulls(len(values["payment_id"]), pa.string()),
            ],
            schema=_ARROW_SCHEMA,
        )
        slow_lines = pc.invert(fast)
        rest = batch.filter(slow_lines)
        if not rest.num_rows:
            yield parsed
            continue
        slow, lines = _parse_slowly(rest)
        if not parsed.num_rows:
            yield slow
            continue
        # In the order of the input lines, as if every line had taken one path.
        position = pa.chunked_array(
            [pc.indices_nonzero(fast), pc.indices_nonzero(slow_lines).take(lines)],
            pa.uint64(),
        )
        both = pa.Table.from_batches([parsed, slow])
        yield from both.take(pc.sort_indices(position)).combine_chunks().to_batches()


def _parse_slowly(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.Array]:
    """`batch`'s lines, each through `parse_payment_line`, and the positions in `batch` of the
    lines that gave a row (blank lines give none)."""
    import pyarrow as pa

    cols: dict[str, list] = {name: [] for name in _ARROW_SCHEMA.names}
    lines: list[int] = []
    data = batch.to_pydict()
    for i, (idx, path, line, raw) in enumerate(
        zip(
            data["_file_idx"], data["_source_file"], data["_source_line"], data["_raw"], strict=True
        )
    ):
        parsed = parse_payment_line(raw)
        if parsed is None:
            continue
        lines.append(i)
        cols["_file_idx"].append(idx)
        cols["_source_file"].append(path)
        cols["_source_line"].append(line)
        if isinstance(parsed, Payment):
            for name in _FIELDS:
                cols[name].append(getattr(parsed, name))
            cols["_raw_text"].append(None)
            cols["_reason"].append(None)
        else:
            assert isinstance(parsed, Invalid)
            for name in _FIELDS:
                cols[name].append(None)
            cols["_raw_text"].append(_raw_text(raw))
            cols["_reason"].append(parsed.reason)
    return pa.RecordBatch.from_pydict(cols, schema=_ARROW_SCHEMA), pa.array(lines, pa.int64())


def _arrow_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("_file_idx", pa.int32()),
            ("_source_file", pa.string()),
            ("_source_line", pa.int64()),
            ("payment_id", pa.string()),
            ("merchant_id", pa.string()),
            ("customer_id", pa.string()),
            ("amount_cents", pa.int64()),
            ("currency", pa.string()),
            ("created_at", pa.timestamp("us", tz="UTC")),
            ("_raw_text", pa.string()),
            ("_reason", pa.string()),
        ]
    )


_ARROW_SCHEMA = _arrow_schema()


# Raw lines → one row per non-blank line: the payment's fields, or `_reason` if invalid. Run
# batch by batch in the landing source's own read step.
parse_payments = ArrowParse(_parse_batches, PARSED_SCHEMA, keeps_order=True)


def transform_payments(valid: DataFrame, ctx: WindowContext) -> Mapping[str, DataFrame]:
    """Valid, first-occurrence payments → the `payments` rows and the balance deltas."""
    from pyspark.sql import functions as F

    payments = valid.select(
        "payment_id",
        "merchant_id",
        "customer_id",
        "amount_cents",
        "currency",
        "created_at",
        ctx.window_id_column().alias("_window_id"),
        "_source_file",
        "_source_line",
    )
    balances = payments.groupBy("merchant_id", "currency").agg(
        # decimal(38,0): a window's sum of 64-bit amounts cannot overflow on the way.
        F.sum(F.col("amount_cents").cast("decimal(38,0)")).alias("total_cents"),
        F.count(F.lit(1)).cast("bigint").alias("payment_count"),
    )
    return {"payments": payments, "balances": balances}


PAYMENTS = Job(
    name="payments",
    description="Payments from JSON-lines landing files into Delta and PostgreSQL, exactly once.",
    source=LandingSource(folder="payments", suffix=".jsonl"),
    deterministic=True,
    parse=parse_payments,
    transform=transform_payments,
    dedupe=Dedupe(key=("payment_id",), state_sink="lake_payments"),
    sinks=(
        DeltaSink(name="lake_payments", output="payments", table="payments"),
        PostgresSink(
            name="pg_payments",
            output="payments",
            table="payments",
            columns=PAYMENT_COLUMNS,
            key=("payment_id",),
            mode="upsert",
            window_column="_window_id",
        ),
        PostgresSink(
            name="pg_merchant_balances",
            output="balances",
            table="merchant_balances",
            columns={
                "merchant_id": "text",
                "currency": "text",
                "total_cents": "bigint",
                "payment_count": "bigint",
            },
            key=("merchant_id", "currency"),
            mode="accumulate",
            accumulate=("total_cents", "payment_count"),
        ),
        quarantine_table("pg_quarantine"),
    ),
    quarantine_sink="pg_quarantine",
    metadata={
        "regex": {"currency": r"^[A-Z]{3}$"},
        "sums": {
            "pg_merchant_balances": {
                "source_sink": "pg_payments",
                "amount": "amount_cents",
                "total": "total_cents",
                "count": "payment_count",
            }
        },
    },
)
