"""The settings resource: onceflow's home, lake and landing folders."""

from __future__ import annotations

import dataclasses
import os

from dagster import ConfigurableResource

from onceflow import Settings


class OnceflowSettingsResource(ConfigurableResource):
    """Where onceflow keeps its state and finds its input; empty fields come from `ONCEFLOW_*`.

    Attributes:
        home: Folder for embedded state (`ONCEFLOW_HOME`, default `.onceflow`).
        lake: Root of the Delta tables (`ONCEFLOW_LAKE`, default `<home>/lake`): a folder or
            `s3://bucket/prefix`.
        landing: Root of the landing files (`ONCEFLOW_LANDING`, default `<home>/landing`): a
            folder or `s3://bucket/prefix`.
    """

    home: str = ""
    lake: str = ""
    landing: str = ""

    def settings(self, postgres_dsn: str | None = None) -> Settings:
        """The onceflow settings: these fields over the environment, with `postgres_dsn`."""
        env = dict(os.environ)
        for name, value in (
            ("ONCEFLOW_HOME", self.home),
            ("ONCEFLOW_LAKE", self.lake),
            ("ONCEFLOW_LANDING", self.landing),
        ):
            if value:
                env[name] = value
        return dataclasses.replace(Settings.from_env(env), postgres_dsn=postgres_dsn)
