"""Locations: a local folder or an S3 prefix, parsed from settings, with secrets kept out."""

from __future__ import annotations

from pathlib import Path

import pytest

from onceflow.errors import ConfigurationError
from onceflow.settings import Settings
from onceflow.storage import Location

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "very-secret-key",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    "AWS_REGION": "eu-west-1",
}


def test_an_s3_location_names_its_bucket_and_keeps_its_secret_out_of_text() -> None:
    lake = Location.parse("s3://bucket/some/prefix/", S3_ENV)
    assert lake.uri == "s3://bucket/some/prefix"
    assert not lake.is_local
    table = lake / "payments"
    assert table.uri == "s3://bucket/some/prefix/payments"
    assert table.fs_path == "bucket/some/prefix/payments"
    assert table.as_uri() == table.uri
    for text in (
        repr(lake),
        str(lake),
        repr(Settings.from_env({"ONCEFLOW_LAKE": lake.uri, **S3_ENV})),
    ):
        assert "very-secret-key" not in text and "AKIDEXAMPLE" not in text
    options = table.delta_options()
    assert options is not None
    assert options["conditional_put"] == "etag"  # the log entry is a conditional put
    assert options["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert options["AWS_ALLOW_HTTP"] == "true"
    assert options["AWS_REGION"] == "eu-west-1"
    with pytest.raises(TypeError):
        Path(table)  # an object is no local path


def test_a_local_location_is_a_path(tmp_path: Path) -> None:
    folder = Location.parse(str(tmp_path / "lake"))
    assert folder.is_local and folder.delta_options() is None
    assert Path(folder / "t") == tmp_path / "lake" / "t"
    assert Location.parse(f"file://{tmp_path}/x").path == tmp_path / "x"
    (folder / "a" / "b.txt").write_bytes(b"hi")
    assert (folder / "a" / "b.txt").read_bytes() == b"hi"
    assert (folder / "a" / "b.txt").size() == 2 and (folder / "a").is_dir()
    assert folder.children() == ["a"]
    assert not list((tmp_path / "lake" / "a").glob(".*.tmp"))  # written whole, then renamed
    (folder / "a").delete_tree()
    assert not (folder / "a").is_dir()
    (folder / "never").delete_tree()  # nothing there is fine
    with pytest.raises(FileNotFoundError):
        (folder / "gone.txt").size()


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("s3:///prefix", {}, "names no bucket"),
        ("gs://bucket/lake", {}, "does not support"),
        ("s3://bucket/lake", {"AWS_ENDPOINT_URL": "localhost:9000"}, "http:// or https://"),
    ],
)
def test_bad_lake_settings_fail_at_load_time(text: str, env: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_env({"ONCEFLOW_LAKE": text, **env})
