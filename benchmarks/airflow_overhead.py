"""The orchestration overhead of Airflow: `dag.test()` of the payments DAG (new input → run →
validate) against `onceflow run payments` alone, and against `run` then `validate` by hand, on
the same generated input, each on a fresh installation, alternating. Run it in the Airflow venv:

    .venv-airflow/bin/python benchmarks/airflow_overhead.py [--runs 2] [--records 20000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"


def fresh_home(at: Path | None = None) -> Path:
    """A new installation (`at`: in that emptied folder)."""
    # Short: the embedded PostgreSQL's socket lives under it.
    if at is None:
        home = Path(tempfile.mkdtemp(prefix="of-"))
    else:
        shutil.rmtree(at, ignore_errors=True)
        at.mkdir(parents=True, exist_ok=True)
        home = at
    os.environ.update(
        ONCEFLOW_HOME=str(home),
        ONCEFLOW_LAKE=str(home / "lake"),
        ONCEFLOW_LANDING=str(home / "landing"),
    )
    return home


def onceflow(*args: str) -> float:
    started = time.monotonic()
    subprocess.run([str(BIN / "onceflow"), *args], check=True, capture_output=True, cwd=REPO)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--files", type=int, default=8)
    args = parser.parse_args()
    airflow_home = Path(tempfile.mkdtemp(prefix="airflow-bench-"))
    os.environ.update(
        AIRFLOW_HOME=str(airflow_home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "integrations" / "airflow" / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        PYSPARK_PYTHON=str(BIN / "python"),
        GX_ANALYTICS_ENABLED="false",
    )
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
                   check=True, capture_output=True)  # fmt: skip
    from onceflow_airflow.dags import build_job_dags, job_catalog

    gen = ["generate", "payments", "--records", str(args.records), "--files", str(args.files)]
    alone, by_hand, dag = [], [], []
    dag_home = Path(tempfile.mkdtemp(prefix="of-dag-"))
    for _ in range(args.runs):
        home = fresh_home()
        onceflow(*gen)
        alone.append(onceflow("run", "payments"))
        shutil.rmtree(home, ignore_errors=True)

        home = fresh_home()
        onceflow(*gen)
        by_hand.append(onceflow("run", "payments") + onceflow("validate", "payments"))
        shutil.rmtree(home, ignore_errors=True)

        # Every DAG run on one lake location: the DAGs' Assets are named after the sinks, and
        # in one Airflow database an Asset of a known name with another URI is inactive (a
        # task with it as an outlet fails), as it would be for a lake moved without the DAG
        # processor parsing the DAGs again.
        home = fresh_home(dag_home)
        onceflow(*gen)
        dags = build_job_dags("payments", jobs=job_catalog(refresh=True))
        started = time.monotonic()
        dag_run = dags["payments"].test()
        dag.append(time.monotonic() - started)
        states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
        assert states.get("run") == "success" and states.get("validate") == "success", states
        shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(airflow_home, ignore_errors=True)

    def line(name: str, xs: list[float]) -> str:
        return (
            f"{name:<34} "
            + ", ".join(f"{x:.1f}" for x in xs)
            + f" s (median {statistics.median(xs):.1f})"
        )

    print(f"payments, {args.records} records in {args.files} files, {args.runs} runs each:")
    print(line("onceflow run payments", alone))
    print(line("onceflow run + validate", by_hand))
    print(line("dag.test() of the payments DAG", dag))
    print(f"dag.test / run alone:      {statistics.median(dag) / statistics.median(alone):.2f}x")
    print(f"dag.test / run + validate: {statistics.median(dag) / statistics.median(by_hand):.2f}x")


if __name__ == "__main__":
    main()
