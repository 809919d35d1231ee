"""The jobs as Dagster components (`components/defs/<job>/defs.yaml`): loaded by
`load_from_defs_folder` and by `dg`, they give the same definitions as `definitions.py`; a
user's job gets its definitions from a `defs.yaml` naming its import path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import AssetKey, Definitions, load_from_defs_folder

import definitions
from components.job import resolve_job
from onceflow import ConfigurationError
from tests.support.orders_data import user_project_on_path

ROOT = Path(__file__).resolve().parents[2]
DEFS = ROOT / "components" / "defs"
# What Dagster adds to the assets a component makes: where they come from.
COMPONENT_METADATA = {"dagster/code_references", "dagster/component_origin"}


def _summary(defs: Definitions) -> dict[str, object]:
    """What the two ways of loading must agree on: every key and name, each asset's
    upstream, definition metadata and check blocking, each schedule's cron."""
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    return {
        "assets": {
            k.to_user_string(): (
                sorted(p.to_user_string() for p in graph.get(k).parent_keys),
                sorted(set(graph.get(k).metadata) - COMPONENT_METADATA),
                graph.get(k).metadata.get("dagster/table_name"),
            )
            for k in graph.get_all_asset_keys()
        },
        "checks": {
            (k.asset_key.to_user_string(), k.name): graph.get_check_spec(k).blocking
            for k in graph.asset_check_keys
        },
        "jobs": sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__")),
        "sensors": sorted(s.name for s in repo.sensor_defs),
        "schedules": {s.name: s.cron_schedule for s in repo.schedule_defs},
        "resources": sorted(defs.resources or {}),
    }


def test_defs_folder_gives_the_definitions_of_definitions_py() -> None:
    from_folder = load_from_defs_folder(path_within_project=DEFS)
    Definitions.validate_loadable(from_folder)
    assert _summary(from_folder) == _summary(definitions.defs)
    # daily_totals' component finds the asset that writes the table it reads.
    graph = from_folder.get_repository_def().asset_graph
    assert graph.get(AssetKey("pg_daily_totals")).parent_keys == {AssetKey("lake_payments")}


def _dg() -> str:
    """`dg` of this environment (dagster-dg-cli, a dev dependency)."""
    found = Path(sys.executable).with_name("dg")
    path = str(found) if found.exists() else shutil.which("dg")
    assert path, "dg is not installed: `make setup` installs dagster-dg-cli (pyproject's dev)"
    return path


def _run_dg(*args: str) -> subprocess.CompletedProcess[str]:
    # The Dagster layer (components/, assets/, …) is imported from the repository root, as
    # `dagster dev` does with its working directory; the core from the editable install.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [_dg(), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path, "DAGSTER_DISABLE_TELEMETRY": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dg_check_and_list_defs() -> None:
    checked = _run_dg("check", "defs", "--use-active-venv")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "All definitions loaded successfully" in checked.stdout
    listed = _run_dg("list", "defs", "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    found = json.loads(listed.stdout)
    want = _summary(definitions.defs)
    assert {a["asset_key"] for a in found["assets"]} == set(want["assets"])  # type: ignore[arg-type]
    assert {(c["asset_key"], c["name"]) for c in found["asset_checks"]} == set(want["checks"])  # type: ignore[arg-type]
    assert sorted(s["name"] for s in found["sensors"]) == want["sensors"]
    assert {s["name"]: s["cron_schedule"] for s in found["schedules"]} == want["schedules"]
    # Each definition is traced to the component that made it.
    sources = {s["name"]: s["source"] for s in found["schedules"]}
    assert sources["payments_reconcile_schedule"].startswith("components/defs/payments/defs.yaml")


@pytest.fixture()
def user_dg_project(tmp_path: Path) -> Iterator[Path]:
    """A user's dg project whose one component names the user's job by import path."""
    root = tmp_path / "shop"
    (root / "shop_dagster" / "defs" / "orders").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\nroot_module = "shop_dagster"\n'
    )
    (root / "shop_dagster" / "__init__.py").write_text("")
    (root / "shop_dagster" / "defs" / "__init__.py").write_text("")
    # The resources, once for every job's component, as onceflow's own defs folder has them.
    (root / "shop_dagster" / "defs" / "resources.py").write_text(
        "import dagster as dg\n\nfrom resources import default_resources\n\n\n"
        "@dg.definitions\ndef resources() -> dg.Definitions:\n"
        "    return dg.Definitions(resources=default_resources())\n"
    )
    (root / "shop_dagster" / "defs" / "orders" / "defs.yaml").write_text(
        "type: components.OnceflowJobComponent\n"
        "attributes:\n"
        "  job: orders_jobs:ORDERS\n"
        '  reconcile_cron: "*/15 * * * *"\n'
    )
    sys.path.insert(0, str(root))
    try:
        with user_project_on_path():
            yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.split(".")[0] == "shop_dagster"]:
            del sys.modules[name]


def test_a_users_job_by_import_path_with_its_own_cadence(user_dg_project: Path) -> None:
    defs = load_from_defs_folder(path_within_project=user_dg_project)
    repo = defs.get_repository_def()
    keys = {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()}
    assert keys == {"orders_landing", "pg_orders", "orders_quarantine", "orders_recovery"}
    assert {s.name: s.cron_schedule for s in repo.schedule_defs} == {
        "orders_reconcile_schedule": "*/15 * * * *",
        "orders_maintenance_schedule": "30 3 * * *",
    }
    assert {s.name for s in repo.sensor_defs} == {
        f"orders_{kind}_sensor" for kind in ("new_data", "failure", "quality")
    }


def test_an_unknown_job_names_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"no job named 'nope'.*daily_totals, payments"):
        resolve_job("nope")
    with pytest.raises(ConfigurationError, match="cannot import 'no_such_module'"):
        resolve_job("no_such_module:JOB")
