"""The CSV an executor spools for a PostgreSQL sink's COPY, as it is made against Arrow's writer
alone, on the same parsed `payments` rows.

The rows are a window's worth of generated lines through the job's parse, narrowed to the
`payments` sink's columns, in batches of Spark's Arrow batch size. "writer" is Arrow's CSV writer
on the batches as they come (its zoned timestamps converted value by value); "onceflow" is what
`CopyWriter`'s handle does (`_utc_as_text`, then the writer). It prints the best of `--repeat`
for each, their ratio, and whether the two spool the same text (quotes aside).
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

from onceflow._pgcopy import _utc_as_text
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENT_COLUMNS, _parse_batches
from onceflow.sources.landing import _lines_batch

BATCH_ROWS = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default


def _spool(batches: list[pa.RecordBatch], prepare) -> bytes:
    options = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    out = io.BytesIO()
    for batch in batches:
        pacsv.write_csv(prepare(pa.Table.from_batches([batch])), out, options)
    return out.getvalue()


def _best(repeat: int, run) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=19_000, help="about a window's worth")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="onceflow-copy-csv-") as tmp:
        generate_payments(Path(tmp), records=args.records, files=1, seed=1)
        (path,) = sorted(Path(tmp).rglob("*.jsonl"))
        lines = _lines_batch(0, path.name, path.read_bytes())
    assert lines is not None
    parsed = pa.Table.from_batches(list(_parse_batches(iter([lines]))))
    valid = parsed.filter(parsed.column("_reason").is_null())
    rows = valid.append_column("_window_id", pa.array([7] * valid.num_rows, pa.int64()))
    rows = rows.select(list(PAYMENT_COLUMNS)).combine_chunks()
    batches = rows.to_batches(max_chunksize=BATCH_ROWS)

    plain = _spool(batches, lambda t: t)
    ours = _spool(batches, _utc_as_text)
    writer_s = _best(args.repeat, lambda: _spool(batches, lambda t: t))
    onceflow_s = _best(args.repeat, lambda: _spool(batches, _utc_as_text))
    print(f"rows: {rows.num_rows:,} in {len(batches)} batches, {len(ours):,} bytes of CSV")
    print(f"Arrow's writer alone:   {writer_s * 1000:7.1f} ms")
    print(f"onceflow's COPY spool:  {onceflow_s * 1000:7.1f} ms")
    print(f"onceflow / writer:      {onceflow_s / writer_s:7.2f}x")
    same = ours.replace(b'"', b"") == plain.replace(b'"', b"")
    print(f"same text, quotes aside: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
