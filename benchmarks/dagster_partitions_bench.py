"""Measures a SQLite Dagster instance holding one dynamic partition per window, and the alternative.

Usage: `python benchmarks/dagster_partitions_bench.py [--partitions 100000] [--batch 1000]`.

A: one dynamic partition per window (100,000 ≈ a year of 5-minute windows): time to add them in
batches, `get_dynamic_partitions` / `has_dynamic_partition` time, instance size on disk.
B: no partitions; a run covers every window it found and reports window ids as metadata on one
materialisation per sink asset: time to record N materialisations, to read the latest, and size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def _instance(home: Path):
    from dagster import DagsterInstance

    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["DAGSTER_HOME"] = str(home)
    return DagsterInstance.get()


def bench_partitions(home: Path, total: int, batch: int) -> dict[str, float]:
    """Adds `total` dynamic partitions in batches and times reads."""
    instance = _instance(home)
    name = "payments_windows"
    started = time.perf_counter()
    slowest = 0.0
    for start in range(1, total + 1, batch):
        t0 = time.perf_counter()
        instance.add_dynamic_partitions(
            name, [f"w{n:09d}" for n in range(start, min(start + batch, total + 1))]
        )
        slowest = max(slowest, time.perf_counter() - t0)
    add_s = time.perf_counter() - started
    t0 = time.perf_counter()
    keys = instance.get_dynamic_partitions(name)
    get_s = time.perf_counter() - t0
    assert len(keys) == total, len(keys)
    t0 = time.perf_counter()
    for n in range(1, 101):
        instance.has_dynamic_partition(name, f"w{n * (total // 100):09d}")
    has_ms = (time.perf_counter() - t0) * 10
    t0 = time.perf_counter()
    instance.add_dynamic_partitions(name, [f"w{total + 1:09d}"])
    one_add_ms = (time.perf_counter() - t0) * 1000
    instance.dispose()
    return {
        "partitions": total,
        "add_total_s": round(add_s, 2),
        "add_slowest_batch_s": round(slowest, 3),
        "add_one_more_ms": round(one_add_ms, 1),
        "get_dynamic_partitions_s": round(get_s, 3),
        "has_dynamic_partition_ms": round(has_ms, 2),
        "instance_mb": round(_size_mb(home), 1),
    }


def bench_metadata(home: Path, runs: int) -> dict[str, float]:
    """Records `runs` materialisations of 4 sink assets with window metadata (no partitions)."""
    from dagster import AssetKey, AssetMaterialization, MetadataValue

    instance = _instance(home)
    keys = [
        AssetKey(k)
        for k in ("lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine")
    ]
    started = time.perf_counter()
    for n in range(1, runs + 1):
        for key in keys:
            instance.report_runless_asset_event(
                AssetMaterialization(
                    asset_key=key,
                    metadata={
                        "windows": MetadataValue.text(f"{n}"),
                        "window_first": MetadataValue.int(n),
                        "window_last": MetadataValue.int(n),
                        "rows_written": MetadataValue.int(1000),
                        "delta_version": MetadataValue.int(n),
                        "commit_latency_s": MetadataValue.float(0.05),
                        "files": MetadataValue.json({str(n): [f"payments/f{n}.jsonl"]}),
                    },
                )
            )
    record_s = time.perf_counter() - started
    t0 = time.perf_counter()
    latest = instance.get_latest_materialization_event(keys[0])
    latest_ms = (time.perf_counter() - t0) * 1000
    assert latest is not None
    instance.dispose()
    return {
        "runs_x4_assets": runs,
        "record_total_s": round(record_s, 2),
        "record_per_event_ms": round(record_s / (runs * len(keys)) * 1000, 2),
        "latest_materialization_ms": round(latest_ms, 1),
        "instance_mb": round(_size_mb(home), 1),
        "mb_per_100k_windows_one_per_run": round(_size_mb(home) / runs * 100_000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--partitions", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(
            "A dynamic partitions:", bench_partitions(Path(tmp) / "a", args.partitions, args.batch)
        )
        print("B run metadata:", bench_metadata(Path(tmp) / "b", args.runs))


if __name__ == "__main__":
    main()
