"""Times the Dagster UI (GraphQL + headless Chromium) for 100,000 dynamic partitions vs none."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "tests" / "artifacts" / "ui-bench"
VENV_BIN = Path(sys.executable).parent

DEFS = """
from dagster import Definitions, DynamicPartitionsDefinition, asset

@asset(partitions_def=DynamicPartitionsDefinition(name="windows"))
def windowed() -> None: ...

@asset
def plain() -> None: ...

defs = Definitions(assets=[windowed, plain])
"""

WINDOWED_QUERY = """
{ assetNodeOrError(assetKey: {path: ["windowed"]}) { ... on AssetNode {
    partitionKeysByDimension { name partitionKeys }
    partitionStats { numMaterialized numPartitions numFailed numMaterializing }
    assetPartitionStatuses { ... on DefaultPartitionStatuses {
        materializedPartitions failedPartitions materializingPartitions } }
} } }
"""

PLAIN_LATEST_QUERY = """
{ assetNodeOrError(assetKey: {path: ["plain"]}) { ... on AssetNode {
    assetMaterializations(limit: 1) { timestamp runId metadataEntries { label } }
} } }
"""

PLAIN_HISTORY_QUERY = """
{ assetNodeOrError(assetKey: {path: ["plain"]}) { ... on AssetNode {
    assetMaterializations(limit: 100) { timestamp runId metadataEntries { label } }
} } }
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def populate(home: Path, partitions: int, batch: int, materialised: int, events: int) -> None:
    """Fills a fresh SQLite instance: partitions, a few partition events, many plain events."""
    from dagster import AssetKey, AssetMaterialization, DagsterInstance, MetadataValue

    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["DAGSTER_HOME"] = str(home)
    instance = DagsterInstance.get()
    for start in range(1, partitions + 1, batch):
        keys = [f"w{n:09d}" for n in range(start, min(start + batch, partitions + 1))]
        instance.add_dynamic_partitions("windows", keys)
    for n in range(1, materialised + 1):
        instance.report_runless_asset_event(
            AssetMaterialization(asset_key=AssetKey("windowed"), partition=f"w{n:09d}")
        )
    for n in range(1, events + 1):
        instance.report_runless_asset_event(
            AssetMaterialization(
                asset_key=AssetKey("plain"),
                metadata={
                    "windows": MetadataValue.text(f"{n}"),
                    "window_first": MetadataValue.int(n),
                    "window_last": MetadataValue.int(n),
                    "rows_written": MetadataValue.int(1000),
                    "files": MetadataValue.json({str(n): [f"payments/f{n}.jsonl"]}),
                },
            )
        )
    instance.dispose()


def graphql(base: str, query: str) -> tuple[float, dict[str, object]]:
    """Posts one query; returns (seconds, parsed response)."""
    body = json.dumps({"query": query}).encode()
    request = urllib.request.Request(
        f"{base}/graphql", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        payload = json.loads(response.read())
    elapsed = time.perf_counter() - started
    if payload.get("errors"):
        raise RuntimeError(payload["errors"])
    return elapsed, payload


def chromium(url: str, profile: Path, extra: list[str]) -> tuple[float, str]:
    """Runs headless Chromium once; returns (wall seconds, stdout)."""
    command = [
        "/usr/bin/chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        "--virtual-time-budget=30000",
        *extra,
        url,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    return time.perf_counter() - started, done.stdout


def median_s(samples: list[float]) -> str:
    return f"{statistics.median(samples):.2f} s (max {max(samples):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--partitions", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--materialised", type=int, default=10)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    SHOTS.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        defs = tmp / "defs.py"
        defs.write_text(DEFS)
        home = tmp / "home"
        t0 = time.perf_counter()
        populate(home, args.partitions, args.batch, args.materialised, args.events)
        print(f"populated in {time.perf_counter() - t0:.1f} s", flush=True)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "DAGSTER_HOME": str(home)}
        log = (tmp / "webserver.log").open("w")
        command = [str(VENV_BIN / "dagster-webserver"), "-f", str(defs), "-h", "127.0.0.1"]
        server = subprocess.Popen(
            [*command, "-p", str(port)],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    urllib.request.urlopen(f"{base}/server_info", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError("webserver did not start") from None
                    time.sleep(1)
            queries = {
                "GraphQL `windowed`: partition keys + statuses + stats": WINDOWED_QUERY,
                "GraphQL `plain`: latest materialisation": PLAIN_LATEST_QUERY,
                "GraphQL `plain`: history page of 100 events": PLAIN_HISTORY_QUERY,
            }
            for label, query in queries.items():
                samples = []
                for _ in range(args.repeat):
                    elapsed, payload = graphql(base, query)
                    samples.append(elapsed)
                size_kb = len(json.dumps(payload)) / 1000
                rows.append((label, f"{median_s(samples)}, {size_kb:,.1f} KB"))
                print(label, rows[-1][1], flush=True)
            count_marks = (f"{args.partitions:,}", str(args.partitions))
            pages = {
                "/assets/windowed": ("windowed", *count_marks),
                "/assets/windowed?view=partitions": ("windowed", *count_marks),
                "/assets/plain": ("plain",),
            }
            for path, marks in pages.items():
                samples = []
                found: list[str] = []
                for n in range(args.repeat):
                    elapsed, dom = chromium(base + path, tmp / f"profile{n}", ["--dump-dom"])
                    samples.append(elapsed)
                    found = [mark for mark in marks if mark in dom]
                shot = SHOTS / (path.strip("/").replace("/", "_").replace("?view=", "_") + ".png")
                chromium(base + path, tmp / "profile-shot", [f"--screenshot={shot}"])
                label = f"Chromium `{path}` (dump-dom)"
                rows.append((label, f"{median_s(samples)}, DOM has {found or 'none'}"))
                print(label, rows[-1][1], flush=True)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
            log.close()
    print(f"\npartitions={args.partitions:,} plain events={args.events:,} repeat={args.repeat}")
    print("| | median |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")


if __name__ == "__main__":
    main()
