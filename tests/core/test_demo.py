"""`onceflow demo` as the README's first command runs it: embedded PostgreSQL, a crash, a replay,
every check passing, and the embedded server stopped afterwards."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.cli import CliRun

pytestmark = pytest.mark.slow


@pytest.fixture()
def home() -> Iterator[Path]:
    # Not under pytest's private (0700) temp root: as root, pgserver runs PostgreSQL as its own
    # user, which must be able to reach the data folder.
    root = Path(tempfile.mkdtemp(prefix="onceflow-demo-"))
    root.chmod(0o755)
    yield root / ".onceflow"
    shutil.rmtree(root, ignore_errors=True)


def _postmasters(data: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "postgres" in (proc.info["name"] or "") and str(data) in " ".join(cmdline):
            found.append(proc)
    return found


def test_demo_recovers_exactly_and_stops_its_embedded_server(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env["ONCEFLOW_HOME"] = str(home)
    done = CliRun(["demo", "--records", "4000", "--files", "6"], env, home.parent / "logs").finish()
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "run 1 ended with SIGKILL" in done.stdout
    assert "it replays the planned window" in done.stdout and "window 3:" in done.stdout
    assert "exactly once: every check passed" in done.stdout
    assert "embedded PostgreSQL stopped" in done.stdout
    assert not _postmasters(home / "postgres")
    for chatter in ("log4j", "NativeCodeLoader", "incubator modules"):
        assert chatter not in done.stdout + done.stderr
