"""Thin adapter over Great Expectations 1.x: the only module that imports great_expectations."""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import psycopg
from sqlalchemy.engine import URL

from onceflow.errors import ConfigurationError
from onceflow.quality.suites import CheckSpec, SuiteSpec

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

# The datasource stores only this placeholder; the URL itself reaches GE through the context's
# in-memory runtime environment, so no password lands in great_expectations.yml.
_URL_VARIABLE = "ONCEFLOW_GX_POSTGRES_URL"

# BASIC without sample values: a payments row is sensitive and must not reach Data Docs or logs.
_RESULT_FORMAT: dict[str, Any] = {"result_format": "BASIC", "partial_unexpected_count": 0}

_gx_module: ModuleType | None = None


def _gx() -> ModuleType:
    """Import great_expectations once, lazily: it takes seconds and most callers never need it."""
    global _gx_module
    if _gx_module is None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        try:
            import great_expectations
        except SystemExit as exc:
            # pyspark's Spark Connect helpers call sys.exit when grpc is missing, and GE imports
            # them; that would end the process silently.
            raise ImportError(
                "importing great_expectations exited the interpreter; install the Spark Connect "
                "dependencies (pyspark[connect]: grpcio, grpcio-status, googleapis-common-protos)"
            ) from exc
        _gx_module = great_expectations
    return _gx_module


def sqlalchemy_url(dsn: str) -> URL:
    """Return the SQLAlchemy URL (psycopg 3 driver) of a libpq DSN or URI.

    GE's URL check wants a host, so a Unix-socket directory, a host list or a missing host goes
    into the `host` query parameter (which the psycopg dialect passes on to libpq and which wins
    over the URL's placeholder host `localhost`). Every other libpq parameter is kept as a query
    parameter. The URL's `repr` and `str` hide the password; never log its rendered form.

    Args:
        dsn: A libpq connection string (`key=value …`) or URI.

    Returns:
        The URL.
    """
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    user = params.pop("user", None)
    password = params.pop("password", None)
    dbname = params.pop("dbname", None)
    host = params.pop("host", None)
    port = params.pop("port", None)
    query = {name: str(value) for name, value in params.items() if value is not None}
    url_host = "localhost"
    url_port: int | None = None
    if host and not str(host).startswith("/") and "," not in str(host):
        url_host = str(host)
        if port and str(port).isdigit():
            url_port = int(str(port))
        elif port:
            query["port"] = str(port)
    else:
        # Without a host libpq falls back to PGHOST, then to its default socket; an empty value
        # keeps that fallback instead of the placeholder `localhost`.
        query["host"] = str(host) if host else os.environ.get("PGHOST", "")
        if port:
            query["port"] = str(port)
    return URL.create(
        "postgresql+psycopg",
        username=str(user) if user else None,
        password=str(password) if password else None,
        host=url_host,
        port=url_port,
        database=str(dbname) if dbname else None,
        query=query,
    )


@dataclass(frozen=True)
class Outcome:
    """The result of one check: whether it passed and what was measured (counts only)."""

    spec: CheckSpec
    success: bool
    observed: dict[str, int | float | str]


def _scalar(value: Any) -> int | float | str:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float | str):
        return value
    if hasattr(value, "item"):  # numpy scalars from pandas batches
        return _scalar(value.item())
    return str(value)


def _error_name(message: str | None) -> str:
    # Only the exception's class: its message may quote row values (DESIGN §8).
    match = re.match(r"\s*\(([\w.]+)\)", message or "")
    return match.group(1) if match else "validation error"


def _expectation(spec: CheckSpec) -> Any:
    gx = _gx()
    common: dict[str, Any] = {
        "meta": {"onceflow_check": spec.check},
        "description": spec.description,
    }
    if spec.kind == "unexpected_rows":
        return gx.expectations.UnexpectedRowsExpectation(unexpected_rows_query=spec.query, **common)
    if spec.kind == "row_count":
        return gx.expectations.ExpectTableRowCountToEqual(value=spec.value, **common)
    if spec.kind == "not_null":
        return gx.expectations.ExpectColumnValuesToNotBeNull(column=spec.column, **common)
    if spec.kind == "regex":
        return gx.expectations.ExpectColumnValuesToMatchRegex(
            column=spec.column, regex=spec.regex, **common
        )
    if spec.kind == "value_equals":
        # A one-row aggregate: its max is its value.
        return gx.expectations.ExpectColumnMaxToBeBetween(
            column=spec.column, min_value=spec.value, max_value=spec.value, **common
        )
    raise ConfigurationError(f"unknown check kind {spec.kind!r}")


def _raised(info: Any) -> dict[str, Any] | None:
    """Return the first raised exception in a result's exception_info, flat or per metric."""
    if not isinstance(info, dict):
        return None
    if info.get("raised_exception"):
        return info
    for value in info.values():
        if isinstance(value, dict) and value.get("raised_exception"):
            return value
    return None


def _outcome(spec: CheckSpec, result: Any) -> Outcome:
    raised = _raised(result.exception_info)
    if raised is not None:
        log.debug("check %s raised", spec.check)
        return Outcome(spec, False, {"error": _error_name(raised.get("exception_message"))})
    values = result.result or {}
    if spec.kind in ("not_null", "regex"):
        measured = values.get("unexpected_count")
    else:
        measured = values.get("observed_value")
    observed: dict[str, int | float | str] = {}
    if measured is not None:
        observed[spec.observed_key] = _scalar(measured)
    if spec.kind in ("row_count", "value_equals") and spec.value is not None:
        observed["expected"] = spec.value
    if spec.kind in ("not_null", "regex") and values.get("element_count") is not None:
        observed["rows"] = _scalar(values["element_count"])
    return Outcome(spec, bool(result.success), observed)


class GxSession:
    """One GE data context for one validation run.

    Ephemeral when `docs_dir` is None; otherwise a file context rooted at `docs_dir`, so suites,
    validation results and Data Docs accumulate there across runs.
    """

    def __init__(self, job: str, *, dsn: str | None, docs_dir: Path | None) -> None:
        """Open the context.

        Args:
            job: The job's name; datasource names are derived from it.
            dsn: The libpq DSN of the database holding the PostgreSQL sinks, if any.
            docs_dir: Where to keep the file context and Data Docs, or None for none.
        """
        gx = _gx()
        from great_expectations.core.run_identifier import RunIdentifier
        from great_expectations.data_context.types.base import ProgressBarsConfig

        runtime: dict[str, str] = {}
        if dsn is not None:
            runtime[_URL_VARIABLE] = sqlalchemy_url(dsn).render_as_string(hide_password=False)
        if docs_dir is None:
            self._context = gx.get_context(mode="ephemeral", runtime_environment=runtime)
        else:
            docs_dir.mkdir(parents=True, exist_ok=True)
            self._context = gx.get_context(
                mode="file", project_root_dir=str(docs_dir), runtime_environment=runtime
            )
        self._context.variables.progress_bars = ProgressBarsConfig(globally=False)
        self._docs = docs_dir is not None
        if self._docs:
            self._context.variables.save()
        self._job = job
        self._sql_source: Any = None
        self._frame_source: Any = None
        self._run_id = RunIdentifier(
            run_name=f"{job}-{uuid.uuid4().hex[:12]}", run_time=datetime.now(timezone.utc)
        )
        self._has_dsn = dsn is not None

    def _sql(self) -> Any:
        if self._sql_source is None:
            if not self._has_dsn:
                raise ConfigurationError("no PostgreSQL DSN was given")
            self._sql_source = self._context.data_sources.add_or_update_postgres(
                f"{self._job}.postgres", connection_string="${" + _URL_VARIABLE + "}"
            )
        return self._sql_source

    def _frames(self) -> Any:
        if self._frame_source is None:
            self._frame_source = self._context.data_sources.add_or_update_pandas(
                f"{self._job}.aggregates"
            )
        return self._frame_source

    def _run(
        self, suite: SuiteSpec, batch_definition: Any, batch_parameters: dict[str, Any] | None
    ) -> list[Outcome]:
        gx = _gx()
        expectations = [_expectation(spec) for spec in suite.checks]
        ge_suite = self._context.suites.add_or_update(
            gx.ExpectationSuite(name=suite.name, expectations=expectations)
        )
        definition = self._context.validation_definitions.add_or_update(
            gx.ValidationDefinition(name=suite.name, data=batch_definition, suite=ge_suite)
        )
        result = definition.run(
            batch_parameters=batch_parameters, result_format=_RESULT_FORMAT, run_id=self._run_id
        )
        by_check = {
            (r.expectation_config.meta or {}).get("onceflow_check"): r for r in result.results
        }
        outcomes = []
        for spec in suite.checks:
            found = by_check.get(spec.check)
            if found is None:
                outcomes.append(Outcome(spec, False, {"error": "no result"}))
            else:
                outcomes.append(_outcome(spec, found))
        return outcomes

    def validate_query(self, suite: SuiteSpec, asset_query: str) -> list[Outcome]:
        """Run a suite on the rows of a `SELECT` in PostgreSQL.

        Args:
            suite: The suite.
            asset_query: The `SELECT` whose rows are the batch (`{batch}` in queries).

        Returns:
            One outcome per check, in the suite's order.
        """
        try:
            asset = self._sql().add_query_asset(name=suite.name, query=asset_query)
            batch_definition = asset.add_batch_definition_whole_table("all")
            return self._run(suite, batch_definition, None)
        except Exception as exc:  # a missing table or lost connection fails the suite, not the run
            log.debug("suite %s failed to run: %s", suite.name, type(exc).__name__)
            return [Outcome(spec, False, {"error": type(exc).__name__}) for spec in suite.checks]

    def validate_frame(self, suite: SuiteSpec, frame: pd.DataFrame) -> list[Outcome]:
        """Run a suite on a small pandas DataFrame (an aggregate computed elsewhere).

        Args:
            suite: The suite.
            frame: The rows to validate.

        Returns:
            One outcome per check, in the suite's order.
        """
        asset = self._frames().add_dataframe_asset(name=suite.name)
        batch_definition = asset.add_batch_definition_whole_dataframe("all")
        return self._run(suite, batch_definition, {"dataframe": frame})

    def build_docs(self) -> str | None:
        """Render this run's results into Data Docs and return the index page's path.

        Returns:
            The path of `index.html`, or None for an ephemeral context.
        """
        if not self._docs:
            return None
        from great_expectations.data_context.types.resource_identifiers import (
            ExpectationSuiteIdentifier,
        )

        store = self._context.validation_results_store
        # Rebuild only this run's pages (plus the index): a full build grows with the history.
        ours = [key for key in store.list_keys() if key.run_id.run_name == self._run_id.run_name]
        suites = {key.expectation_suite_identifier.name for key in ours}
        resources = ours + [ExpectationSuiteIdentifier(name=name) for name in sorted(suites)]
        sites = self._context.build_data_docs(resource_identifiers=resources)
        for location in sites.values():
            parsed = urlparse(location)
            return unquote(parsed.path) if parsed.scheme == "file" else location
        return None

    def close(self) -> None:
        """Release the database connections GE pooled."""
        if self._sql_source is not None:
            for engine in (
                self._sql_source.get_engine(),
                self._sql_source.get_execution_engine().engine,
            ):
                engine.dispose()
