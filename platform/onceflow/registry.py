"""Where onceflow finds jobs: user modules named in `ONCEFLOW_JOBS` or `[tool.onceflow] jobs`.

An entry is an import path: `package.module` (every `Job` defined at the module's top level)
or `package.module:NAME` (one `Job`, a sequence of jobs, or a function returning either).
`ONCEFLOW_JOBS` (comma-separated; the working directory is put on `sys.path`, as `python -m`
does) wins over the nearest `pyproject.toml` that has a `[tool.onceflow]` table (looked for
from the working directory up; its folder is put on `sys.path`, as Dagster does with a code
location's working directory). With neither, the reference jobs `payments` and `daily_totals`
are loaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onceflow.errors import ConfigurationError
from onceflow.job import Job

JOBS_ENV = "ONCEFLOW_JOBS"
REFERENCE_JOBS: tuple[str, ...] = ("onceflow.jobs.payments", "onceflow.jobs.daily_totals")


@dataclass(frozen=True)
class JobSet:
    """The jobs onceflow knows, by name, and where the list came from."""

    jobs: Mapping[str, Job]
    origin: str

    def get(self, name: str) -> Job:
        """The job named `name`.

        Raises:
            ConfigurationError: No such job.
        """
        try:
            return self.jobs[name]
        except KeyError:
            raise ConfigurationError(
                f"no job named {name!r}; known jobs ({self.origin}): "
                f"{', '.join(sorted(self.jobs)) or 'none'}."
            ) from None

    @property
    def names(self) -> list[str]:
        return list(self.jobs)


def _read_pyproject(start: Path) -> tuple[list[str], Path] | None:
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if not candidate.is_file():
            continue
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            data = tomllib.loads(candidate.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"{candidate} cannot be read ({exc}); fix the file.") from None
        table = data.get("tool", {}).get("onceflow")
        if table is None:
            return None
        jobs = table.get("jobs")
        if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
            raise ConfigurationError(
                f"{candidate}: [tool.onceflow] jobs must be a list of import paths, such as "
                '["mypackage.jobs", "mypackage.billing:INVOICES"].'
            )
        return jobs, folder
    return None


def _collect(value: Any, where: str) -> list[Job]:
    if callable(value) and not isinstance(value, Job):
        value = value()
    if isinstance(value, Job):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        items = list(value)
        if all(isinstance(v, Job) for v in items):
            return items
    raise ConfigurationError(
        f"{where} is a {type(value).__name__}, not an onceflow Job (or a list of them, or a "
        "function returning them)."
    )


def _load_entry(entry: str, setting: str) -> list[Job]:
    module_name, _, attr = entry.strip().partition(":")
    if not module_name:
        raise ConfigurationError(f"{setting}: {entry!r} is not an import path like pkg.jobs.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"{setting}: cannot import {module_name!r} ({exc}); check the name, and run onceflow "
            "from the module's folder or put that folder on the Python path (PYTHONPATH)."
        ) from None
    except ConfigurationError as exc:
        raise ConfigurationError(f"{setting}: {module_name}: {exc.message}") from None
    except Exception as exc:
        # A syntax error or an exception raised by the module's own code: still a job module
        # that cannot be loaded. The cause stays chained for a traceback.
        raise ConfigurationError(
            f"{setting}: importing {module_name!r} failed with {type(exc).__name__}: {exc}"
        ) from exc
    if attr:
        if not hasattr(module, attr):
            raise ConfigurationError(f"{setting}: module {module_name} has no {attr!r}.")
        return _collect(getattr(module, attr), entry)
    jobs = [v for v in vars(module).values() if isinstance(v, Job)]
    if not jobs:
        raise ConfigurationError(
            f"{setting}: module {module_name} defines no onceflow Job at its top level."
        )
    return jobs


def load_jobs(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> JobSet:
    """Find and import the configured jobs.

    Args:
        env: The environment (default `os.environ`).
        cwd: Where to look for `pyproject.toml` (default the working directory).

    Raises:
        ConfigurationError: An entry cannot be imported, is not a job, or two jobs (or two
            sinks of different jobs, which are Dagster asset keys) share a name.
    """
    env = os.environ if env is None else env
    given = env.get(JOBS_ENV, "").strip()
    here = (cwd or Path.cwd()).absolute()
    if given:
        entries = [e for e in given.split(",") if e.strip()]
        origin = JOBS_ENV
        # The `onceflow` script's own folder is on the path, not the user's: without this a
        # module beside the user would be found only with PYTHONPATH=. set.
        _on_path(here)
    else:
        found = _read_pyproject(here)
        if found is not None:
            entries, folder = found
            origin = f"[tool.onceflow] in {folder / 'pyproject.toml'}"
            _on_path(folder)
        else:
            entries, origin = list(REFERENCE_JOBS), "the reference jobs"
    jobs: dict[str, Job] = {}
    sink_owner: dict[str, str] = {}
    for entry in entries:
        for job in _load_entry(entry, origin):
            if job.name in jobs and jobs[job.name] is not job:
                raise ConfigurationError(
                    f"two jobs are named {job.name!r} ({origin}); job names must be unique."
                )
            jobs[job.name] = job
    for job in jobs.values():
        for sink in job.sinks:
            owner = sink_owner.setdefault(sink.name, job.name)
            if owner != job.name:
                raise ConfigurationError(
                    f"jobs {owner} and {job.name} both have a sink named {sink.name!r}; sink "
                    "names are asset keys in Dagster and must be unique across jobs."
                )
    return JobSet(jobs, origin)


def _on_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def get_job(name: str) -> Job:
    """The configured job named `name` (see `load_jobs`)."""
    return load_jobs().get(name)
