"""The `payments` parse, line by line against the job's batch parse, on the same generated lines.

Both run in this process on one Arrow batch of raw lines, as a Python worker gets them. The
batch parse takes compact lines through Arrow kernels (`onceflow.jobs._payments_fast`) and the
rest through the per-line parser; the line-by-line figure sends every line through the per-line
parser, as the job did before. It prints the share of lines the fast path took and each parse's
best time of `--repeat` over the same batch, with their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from onceflow.generate import generate_payments
from onceflow.jobs._payments_fast import parse_canonical
from onceflow.jobs.payments import _parse_batches, _parse_slowly
from onceflow.sources.landing import _lines_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=19_000, help="about a window's worth")
    parser.add_argument("--duplicate-rate", type=float, default=0.05)
    parser.add_argument("--invalid-rate", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="onceflow-parse-") as tmp:
        made = generate_payments(
            Path(tmp),
            records=args.records,
            files=1,
            duplicate_rate=args.duplicate_rate,
            invalid_rate=args.invalid_rate,
            seed=1,
        )
        # The batch the landing source hands the parse.
        batch = _lines_batch(0, f"payments/{made.files[0].name}", made.files[0].read_bytes())
    assert batch is not None
    lines = batch.num_rows

    def best(run: object) -> float:
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            run()  # type: ignore[operator]
            times.append(time.perf_counter() - started)
        return min(times)

    fast_share = parse_canonical(batch.column("_raw"))[0].true_count / lines
    one_by_one = best(lambda: _parse_slowly(batch))
    batched = best(lambda: list(_parse_batches(iter([batch]))))
    print(f"lines: {lines:,}; taken by the vectorised path: {fast_share:.1%}")
    print(f"line by line:   {one_by_one * 1000:7.1f} ms  ({lines / one_by_one:,.0f} lines/s)")
    print(f"batch parse:    {batched * 1000:7.1f} ms  ({lines / batched:,.0f} lines/s)")
    print(f"batch / line by line time: {batched / one_by_one:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
