"""A load's `lora_path` as an `s3://` prefix (files put into moto first), as `file:///…`, and the refusals:
a file missing under a prefix names it, a folder outside the adapter roots is refused before a byte is
read, a URL that cannot be parsed is a 400, and the copy opens only regular files under the roots. What decides whether a version is the same is its digest, so each source is compared with a load
of the same folder. (SQLite only: nothing here depends on the database; uploads run on both.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from control_plane.artifacts.sources import open_under
from control_plane.settings import ControlPlaneSettings
from shared.errors import ConflictError
from shared.peft import WEIGHTS_NAME
from tests.control_plane.artifacts.conftest import S3
from tests.control_plane.artifacts.helpers import blob_rows, files_of, recorded, sha, stored_objects
from tests.control_plane.conftest import admin


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'control.db'}"


async def load(client: AsyncTestClient, name: str, lora_path: str) -> dict:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": lora_path, "base_model": "demo"})
    return {"status": r.status_code, **r.json()}


async def test_an_s3_prefix_is_copied_into_the_store(client: AsyncTestClient, demo: dict, s3: S3,
                                                     settings: ControlPlaneSettings) -> None:
    files = files_of(demo["demo-poet"])
    for name, data in files.items():
        s3.put(f"adapters/poet/{name}", data)
    s3.put("adapters/poet/README.md", b"not part of a version")
    folder = await load(client, "from-folder", str(demo["demo-poet"]))
    for i, lora_path in enumerate((f"{s3.url}/adapters/poet", f"{s3.url}/adapters/poet/")):
        body = await load(client, "from-s3", lora_path)
        assert body["status"] == 200, body
        assert body["sha256"] == folder["sha256"] and body["version"] == 1 and body["created"] is (i == 0)
    detail = (await client.get("/v1/lora_adapters/from-s3", headers=admin())).json()
    assert detail["versions"][0]["uri"] == f"{s3.url}/adapters/poet"  # where it came from, for people
    assert stored_objects(settings) == sorted(sha(d) for d in files.values()) == await blob_rows(settings.database_url)


async def test_a_file_missing_under_an_s3_prefix_is_named(client: AsyncTestClient, demo: dict, s3: S3,
                                                          settings: ControlPlaneSettings) -> None:
    s3.put("half/adapter_config.json", files_of(demo["demo-poet"])["adapter_config.json"])
    body = await load(client, "half", f"{s3.url}/half/")
    assert body["status"] == 400, body
    assert body["error"]["param"] == "lora_path"
    assert "adapter_model.safetensors is missing under 's3://artifacts/" in body["error"]["message"]
    nothing = await load(client, "none", "s3://no-such-bucket/x/")
    assert nothing["status"] == 400 and "s3://no-such-bucket/x/" in nothing["error"]["message"], nothing
    assert await recorded(settings.database_url) == (0, 0, 0, 0)
    assert stored_objects(settings) == []


async def test_a_file_url_is_the_folder_it_names(client: AsyncTestClient, demo: dict) -> None:
    folder = await load(client, "plain", str(demo["demo-short"]))
    as_url = await load(client, "as-url", demo["demo-short"].as_uri())
    assert as_url["status"] == 200 and as_url["sha256"] == folder["sha256"], as_url
    localhost = await load(client, "localhost", "file://localhost" + str(demo["demo-short"]))
    assert localhost["status"] == 200 and localhost["sha256"] == folder["sha256"], localhost
    remote = await load(client, "remote", "file://elsewhere" + str(demo["demo-short"]))
    assert remote["status"] == 400 and "file:///path" in remote["error"]["message"], remote
    other = await load(client, "ftp", "ftp://host/adapter")
    assert other["status"] == 400 and "s3://" in other["error"]["message"], other
    for unparsable in ("s3://[bucket/x", "file://[x/y", "hf://org]/x"):  # an unclosed IPv6 host: a 400, not a 500
        body = await load(client, "bad-url", unparsable)
        assert body["status"] == 400 and "not a valid URL" in body["error"]["message"], body


async def test_a_folder_outside_the_roots_is_refused_before_it_is_read(client: AsyncTestClient, demo: dict,
                                                                      tmp_path: Path) -> None:
    outside = tmp_path / "outside"  # not under settings.adapter_roots
    outside.mkdir()
    (outside / "adapter_config.json").write_bytes(files_of(demo["demo-short"])["adapter_config.json"])
    os.mkfifo(outside / "adapter_model.safetensors")  # reading it would block this test forever
    escape = demo["root"] / os.path.relpath(outside, demo["root"])  # <root>/../…/outside: the same folder
    for lora_path in (str(outside), outside.as_uri(), str(escape)):
        body = await load(client, "outside", lora_path)
        assert body["status"] == 400 and body["error"]["param"] == "lora_path", body
        assert "outside the allowed adapter roots" in body["error"]["message"], body


def test_the_copy_opens_only_regular_files_under_the_roots(demo: dict, tmp_path: Path) -> None:
    """What the copy of a folder opens is checked again where it lies: a link swapped in after the folder
    was checked leads nowhere outside the roots, and a FIFO swapped in does not block the copy."""
    root = tmp_path / "roots"
    shutil.copytree(demo["demo-poet"], root / "poet")
    changed = ConflictError("changed")
    kept = root / "poet" / WEIGHTS_NAME
    with open_under(kept, (str(root),), changed) as fh:
        assert fh.read() == kept.read_bytes()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not under the roots")
    (root / "poet" / "swapped").symlink_to(secret)
    os.mkfifo(root / "poet" / "fifo")
    for path in (root / "poet" / "swapped", root / "poet" / "fifo", secret):
        with pytest.raises(ConflictError):
            open_under(path, (str(root),), changed)
