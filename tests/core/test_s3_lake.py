"""The lake on an S3-compatible store: the project's local S3 server, real `onceflow` processes.

`payments` and `daily_totals` run with `ONCEFLOW_LAKE=s3://…` and must end exact through the
crash matrix (SIGKILL at each fault point, then a rerun) and through answers lost on the way
back from the store: a PUT of a Delta log entry (the commit itself) or of a data file that the
server carried out while the client saw its connection fail.
"""

from __future__ import annotations

import shutil
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deltalake import DeltaTable

from onceflow.generate import generate_payments
from onceflow.ops import EXIT_FAILED, EXIT_RETRYABLE
from onceflow.s3_server import LOCAL_SECRET_KEY, LocalS3
from onceflow.sources import landing as landing_module
from onceflow.storage import Location
from tests.support.cli import CliRun, Finished, cli_env
from tests.support.daily_totals_oracle import (
    assert_totals_exact,
    totals_from_delta,
    totals_from_landing,
)
from tests.support.matrix import points
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact
from tests.support.s3proxy import S3Proxy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    log = tmp_path_factory.mktemp("s3") / "server.log"
    with LocalS3(log=log) as server:
        yield server


@pytest.fixture(scope="module")
def input_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("input")
    generate_payments(root, records=3000, files=6, duplicate_rate=0.1, invalid_rate=0.05)
    return root / "payments"


@dataclass
class S3Site:
    """One installation whose lake is a fresh bucket on the local S3 server."""

    dsn: str
    s3: LocalS3
    lake: Location
    landing: Path
    home: Path
    endpoint: str
    s3_landing: Location | None = None  # the landing folder, when it is on the store too

    def env(self, fault: str | None = None, **extra: str) -> dict[str, str]:
        landing = self.s3_landing.uri if self.s3_landing else self.landing
        return cli_env(
            home=self.home,
            dsn=self.dsn,
            lake=self.lake.uri,  # type: ignore[arg-type]
            landing=landing,  # type: ignore[arg-type]
            fault=fault,
            **{**self.s3.env(), "AWS_ENDPOINT_URL": self.endpoint, **extra},
        )

    def cli(self, *args: str, fault: str | None = None, **extra: str) -> Finished:
        return CliRun(list(args), self.env(fault, **extra), self.home / "logs").finish()

    def payments(self, fault: str | None = None, max_files: int = 2, **extra: str) -> Finished:
        return self.cli(
            "run", "payments", "--max-files-per-window", str(max_files), fault=fault, **extra
        )

    def assert_exact(self) -> None:
        assert_exact(expected_outputs(self.landing), actual_outputs(self.dsn, self.lake))

    def assert_lake_on_s3(self) -> None:
        table = self.lake / "payments"
        assert DeltaTable.is_deltatable(table.uri, storage_options=table.delta_options())
        assert not (self.home / "lake").exists()


@pytest.fixture()
def site(pg_dsn: str, s3: LocalS3, tmp_path: Path, landing: Path, input_files: Path) -> S3Site:
    bucket = f"lake-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(bucket)
    shutil.copytree(input_files, landing / "payments")
    home = tmp_path / "home"
    home.mkdir()
    lake = Location.parse(f"s3://{bucket}/lake", s3.env())
    return S3Site(pg_dsn, s3, lake, landing, home, s3.endpoint)


# Every fault point on the store, with `make test-all`. CI's representative point on the store is
# the one where what the store holds differs most from the local lake's case, a Delta commit on
# the store that PostgreSQL lacks (`after_delta`): test_landing_files_on_the_store_too crashes
# there with the lake (and the landing files) on the store. The local matrix (test_crash.py) has
# every point.
@pytest.mark.parametrize(
    "point",
    points(*("plan", "before_sinks", "after_delta", "pg_commit_sent", "after_commits"), in_ci=()),
)
def test_payments_crash_at_fault_point_then_rerun_is_exact(site: S3Site, point: str) -> None:
    crashed = site.payments(fault=f"{point}@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert f"fault injected at {point} (window 2)" in crashed.stderr

    rerun = site.payments()
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    site.assert_exact()
    site.assert_lake_on_s3()


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(r"/lake/payments/_delta_log/\d{20}\.json$", id="delta-log-entry"),
        pytest.param(
            r"/lake/payments/w\d{10}-.*\.parquet$", id="data-file", marks=pytest.mark.exhaustive
        ),
    ],
)
def test_payments_exact_when_the_answer_to_a_put_is_lost(site: S3Site, target: str) -> None:
    proxy = S3Proxy(f"{site.s3.host}:{site.s3.port}", drop_path=target, drop_from=2).start()
    try:
        site.endpoint = proxy.endpoint
        first = site.payments()
        assert proxy.lost, f"no PUT matched {target}: {proxy.puts[:20]}"
        assert all(lost.status == 200 for lost in proxy.lost)  # the store did carry them out
        # The run either finishes, or fails (retryable: the commit's outcome was unknown) and
        # leaves the rest to the next run.
        assert first.returncode in (0, EXIT_FAILED, EXIT_RETRYABLE), first.stderr[-2000:]
        rerun = site.payments()
        assert rerun.returncode == 0, rerun.stderr[-2000:]
    finally:
        proxy.stop()
    site.assert_exact()
    # No window was committed twice to the Delta table, whatever the retries did.
    table = site.lake / "payments"
    windows = [
        int(entry["onceflow.window_id"])
        for entry in DeltaTable(table.uri, storage_options=table.delta_options()).history()
        if "onceflow.window_id" in entry
    ]
    assert sorted(windows) == sorted(set(windows)), windows


def test_payments_exact_when_listings_show_new_log_entries_late(site: S3Site) -> None:
    """A store whose listings show a new Delta log entry only seconds after it was written: a
    commit made on a stale snapshot meets the entry it cannot see, reads it by name, and tries
    again; nothing is lost or doubled."""
    proxy = S3Proxy(
        f"{site.s3.host}:{site.s3.port}",
        hide_path=r"/lake/payments/_delta_log/(?!0{20}\.json)\d{20}\.json$",
        hide_for_s=2.0,
    ).start()
    try:
        site.endpoint = proxy.endpoint
        first = site.payments(max_files=1)
        assert proxy.hidden, "no listing left a new log entry out"
        assert first.returncode == 0, first.stderr[-2000:]
    finally:
        proxy.stop()
    site.assert_exact()


def test_a_new_table_whose_first_log_entry_is_listed_late_is_created_once(site: S3Site) -> None:
    """The store leaves a new table's first log entry out of listings for seconds: creating
    the table is decided by reading that entry by name, and loading it waits for the listing,
    so the first run finishes exact instead of failing with a table that "does not exist"."""
    proxy = S3Proxy(
        f"{site.s3.host}:{site.s3.port}",
        hide_path=r"/lake/payments/_delta_log/0{20}\.json$",
        hide_for_s=3.0,
    ).start()
    try:
        site.endpoint = proxy.endpoint
        first = site.payments(max_files=3)
        assert proxy.hidden, "no listing left the first log entry out"
        assert first.returncode == 0, first.stderr[-2000:]
    finally:
        proxy.stop()
    site.assert_exact()


# daily_totals's own fault points (its only sink is PostgreSQL, so no `after_delta`).
TOTALS_POINTS = (
    "plan",
    "before_sinks",
    "after_postgres",
    "before_pg_commit",
    "pg_commit_sent",
    "after_commits",
)


# The store is daily_totals's source only: the local matrix (test_daily_totals.py) covers its
# points in CI, these run with `make test-all`.
@pytest.mark.parametrize("point", points(*TOTALS_POINTS, in_ci=()))
def test_daily_totals_on_an_s3_lake_crash_then_rerun_is_exact(site: S3Site, point: str) -> None:
    paid = site.payments(max_files=2)
    assert paid.returncode == 0, paid.stderr[-2000:]

    crashed = site.cli("run", "daily_totals", "--max-files-per-window", "1", fault=f"{point}@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = site.cli("run", "daily_totals")
    assert recovered.returncode == 0, recovered.stderr[-2000:]

    truth = totals_from_landing(site.landing)
    assert totals_from_delta(site.lake) == truth
    diff = assert_totals_exact(truth, site.dsn, f"S3 lake, crash at {point}@2")
    assert diff.lost == diff.doubled == 0


def test_a_missing_bucket_fails_at_load_time_without_the_secret(site: S3Site) -> None:
    site.lake = Location.parse("s3://no-such-bucket/lake", site.s3.env())
    result = site.payments()
    assert result.returncode != 0
    assert "bucket 'no-such-bucket' does not exist" in result.stderr, result.stderr[-2000:]
    secret = site.s3.env()["AWS_SECRET_ACCESS_KEY"]
    assert secret not in result.stderr and secret not in result.stdout


def test_staged_job_replays_its_stage_from_the_store(site: S3Site) -> None:
    """A job not declared deterministic stages each window's outputs under the lake: here on
    the store, and read back from the files its marker names."""
    jobs = {
        "ONCEFLOW_JOBS": "tests.support.staged_payments:STAGED_PAYMENTS",
        "PYTHONPATH": str(REPO),
    }
    crashed = site.payments(fault="pg_commit_sent@2", **jobs)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    stages = site.lake / "_onceflow" / "staging" / "payments"
    (stage,) = stages.children("w0000000002-")
    assert (stages / stage / "_COMPLETE.json").is_file()

    rerun = site.payments(**jobs)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    site.assert_exact()
    assert not stages.children("w")  # every stage is gone once its window is in every sink


def test_landing_files_on_the_store_too(site: S3Site) -> None:
    """Landing files on the store (`ONCEFLOW_LANDING=s3://…`): discovered by listing, read
    whole by the executors; `onceflow generate` writes there with one PUT per file. The run is
    killed after its Delta commit on the store (CI's point of the store's crash matrix)."""
    landing = Location.parse(f"{site.lake.uri.rsplit('/', 1)[0]}/landing", site.s3.env())
    local = site.landing / "payments"
    for path in sorted(local.iterdir()):
        (landing / "payments" / path.name).write_bytes(path.read_bytes())
    site.s3_landing = landing

    crashed = site.payments(fault="after_delta@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "fault injected at after_delta (window 2)" in crashed.stderr
    made = site.cli(
        "generate", "payments", "--records", "400", "--files", "2", "--duplicate-rate", "0.1",
        "--invalid-rate", "0.05", "--seed", "7",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    rerun = site.payments()
    assert rerun.returncode == 0, rerun.stderr[-2000:]

    # The oracle reads a local copy of exactly what the store holds.
    for info in (landing / "payments").files():
        name = info.path.rsplit("/", 1)[1]
        if not (local / name).exists():
            (local / name).write_bytes((landing / "payments" / name).read_bytes())
    assert len(list(local.iterdir())) == 8
    site.assert_exact()
    site.assert_lake_on_s3()


def test_a_landing_file_on_the_store_is_read_in_byte_ranges_as_whole(site: S3Site) -> None:
    """A large window's file on the store, read in ranges by several tasks: each line once,
    at its position, as the whole file's read gives them (ranged GETs, no Spark)."""
    folder = Location.parse(f"{site.lake.uri.rsplit('/', 1)[0]}/ranges", site.s3.env())
    content = b"".join(b'{"n": %d}\n' % i for i in range(2000)) + b"\n\nno final newline"
    (folder / "f.jsonl").write_bytes(content)
    whole = landing_module._lines_batch(0, "f.jsonl", content)
    assert whole is not None
    size = len(content)
    for chunk in (97, 4096, size - 1):
        units = [(0, start, min(size, start + chunk)) for start in range(0, size, chunk)]
        ranges = landing_module._split_units(folder, ["f.jsonl"], units)
        assert [row for batch in ranges for row in batch.to_pylist()] == whole.to_pylist()


# make test-all: reconcile's repair is in CI on the local lake; the store runs the crash and
# the staged replay.
@pytest.mark.exhaustive
def test_reconcile_repairs_damage_done_to_the_table_on_the_store(site: S3Site) -> None:
    """The suites pass on a table on the store; then rows deleted and a row doubled outside
    onceflow: reconcile finds both and repairs the table on the store in one commit (its diff is
    spilled under the lake, on the store)."""
    from deltalake import write_deltalake

    paid = site.payments(max_files=3)
    assert paid.returncode == 0, paid.stderr[-2000:]
    site.assert_exact()
    # The Great Expectations suites read the table on the store: every check passes.
    checked = site.cli("validate", "payments")
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert "lake_payments" in checked.stdout

    path = site.lake / "payments"
    table = DeltaTable(path.uri, storage_options=path.delta_options())
    rows = table.to_pyarrow_table()
    victims = rows.column("payment_id").to_pylist()[:5]
    table.delete(" OR ".join(f"payment_id = '{v}'" for v in victims))
    doubled = rows.slice(10, 1)
    write_deltalake(path.uri, doubled, mode="append", storage_options=path.delta_options())
    with pytest.raises(AssertionError):
        site.assert_exact()

    repaired = site.cli("reconcile", "payments")
    assert repaired.returncode == 0, repaired.stderr[-2000:]
    line = next(x for x in repaired.stdout.splitlines() if x.startswith("lake_payments"))
    assert line.split() == ["lake_payments", "5", "1", "0", "repaired"], repaired.stdout
    site.assert_exact()
    again = site.cli("reconcile", "payments", "--dry-run")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.rstrip().endswith("clean") and "NOT" not in again.stdout, again.stdout


def test_the_s3_server_command_serves_until_sigterm(tmp_path: Path) -> None:
    import subprocess
    import time

    from onceflow.spark_server import free_port
    from tests.support.cli import ONCEFLOW

    port = free_port()
    proc = subprocess.Popen(
        [ONCEFLOW, "s3-server", "--port", str(port), "--bucket", "demo"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}" in line and "ONCEFLOW_LAKE=s3://" in line, line
        assert LOCAL_SECRET_KEY not in line  # no secret is printed, not even the local one
        server = LocalS3(port=port)
        spot = Location.parse("s3://demo/probe.txt", server.env())
        spot.write_bytes(b"here")
        assert spot.read_bytes() == b"here"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while server.up() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.up()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_log_records_are_kept_and_read_back_on_the_store(site: S3Site) -> None:
    """The commit records kept beside a table's log (`sinks/delta/_records.py`) on the store:
    written whole, merged, read back, and still naming every version once the log's oldest
    entries are removed below a checkpoint."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from onceflow.sinks.delta import _records
    from onceflow.sinks.delta.table import DeltaTableSink

    table = site.lake / "records"
    for i in range(_records.MERGE_AT + 3):
        write_deltalake(
            table.uri, pa.table({"n": [i]}), mode="append", storage_options=table.delta_options()
        )
    sink = DeltaTableSink("job", "sink", table)
    newest = sink.table().version()
    for version in range(newest + 1):  # one file a call: merged past MERGE_AT
        assert _records.summarize(sink, version) == version
    assert 1 <= len((table / _records.FOLDER).children()) <= _records.MERGE_AT
    assert sorted(_records.read(sink)) == list(range(newest + 1))
    sink.table().create_checkpoint()
    fs = table.filesystem()
    for version in range(5):
        fs.delete_file((table / "_delta_log" / f"{version:020d}.json").fs_path)
    assert sink.entry_actions(0) is None
    assert _records.whole(sink)
