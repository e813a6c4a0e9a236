"""GET /v1/artifacts/{digest} and /{digest}/{name}: what engines fetch. The manifest is checked against the
files on disk (sizes and sha256 computed here), the file route's bytes and ranges against slices of them,
and who may call it against each kind of token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import msgspec
import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from control_plane.settings import ControlPlaneSettings
from shared.artifacts import ArtifactManifest, manifest_matches
from tests.control_plane.artifacts.conftest import S3
from tests.control_plane.artifacts.helpers import files_of, sha, store_folder
from tests.control_plane.conftest import admin, reader

ENGINE = {"e1": "engine-e1-token-for-tests"}
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def settings(settings: ControlPlaneSettings) -> ControlPlaneSettings:
    return dataclasses.replace(settings, engine_credentials=ENGINE)


async def loaded(client: AsyncTestClient | httpx.AsyncClient, folder: Path, name: str = "poet") -> str:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(folder), "base_model": "demo"})
    assert r.status_code == 200, r.text
    return r.json()["sha256"]


async def test_the_manifest_lists_the_files(client: AsyncTestClient, demo: dict) -> None:
    digest = await loaded(client, demo["demo-poet"])
    r = await client.get(f"/v1/artifacts/{digest}", headers=reader())
    assert r.status_code == 200, r.text
    manifest = msgspec.json.decode(r.content, type=ArtifactManifest)
    files = files_of(demo["demo-poet"])
    assert manifest.digest == digest and manifest_matches(manifest)
    assert [(f.name, f.size, f.sha256, f.url) for f in manifest.files] == [
        (n, len(d), sha(d), None) for n, d in sorted(files.items())]  # a file:// store: no presigned URLs
    assert manifest.size_bytes == sum(map(len, files.values()))


async def test_files_whole_and_in_ranges(client: AsyncTestClient, demo: dict) -> None:
    digest = await loaded(client, demo["demo-poet"])
    data = files_of(demo["demo-poet"])[WEIGHTS]
    size = len(data)
    url = f"/v1/artifacts/{digest}/{WEIGHTS}"
    whole = await client.get(url, headers=reader())
    assert whole.status_code == 200 and whole.content == data
    assert (whole.headers["content-length"], whole.headers["accept-ranges"], whole.headers["x-content-sha256"]) == (
        str(size), "bytes", sha(data))
    for header, start, end in [("bytes=0-0", 0, 1), ("bytes=100-1099", 100, 1100), ("bytes=0-", 0, size),
                               (f"bytes={size - 10}-", size - 10, size), ("bytes=-10", size - 10, size),
                               (f"bytes=-{size + 5}", 0, size), (f"bytes=1000-{size + 99}", 1000, size)]:
        r = await client.get(url, headers={**reader(), "Range": header})
        assert r.status_code == 206, (header, r.text)
        assert r.content == data[start:end], header
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}", header
        assert r.headers["content-length"] == str(end - start), header
    for header in (f"bytes={size}-", f"bytes={size + 1}-{size + 9}", "bytes=-0", "bytes=20-10"):
        r = await client.get(url, headers={**reader(), "Range": header})
        assert r.status_code == 416, (header, r.text)
        assert r.headers["content-range"] == f"bytes */{size}"
        error = r.json()["error"]
        assert error["param"] == "Range" and error["type"] and str(size) in error["message"], error
    for header in ("bytes=1-2,5-6", "items=0-1", "bytes=-", "bytes=a-b"):
        r = await client.get(url, headers={**reader(), "Range": header})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Range", (header, r.text)


async def test_unknown_and_malformed_names(client: AsyncTestClient, demo: dict) -> None:
    digest = await loaded(client, demo["demo-poet"])
    for url, status in [(f"/v1/artifacts/{'0' * 64}", 404), (f"/v1/artifacts/{'0' * 64}/{WEIGHTS}", 404),
                        (f"/v1/artifacts/{digest}/README.md", 404), (f"/v1/artifacts/{digest.upper()}", 400),
                        ("/v1/artifacts/xyz", 400), (f"/v1/artifacts/{digest}/.hidden", 400)]:
        r = await client.get(url, headers=reader())
        assert r.status_code == status, (url, r.text)
        assert r.json()["error"]["message"], r.text


async def test_who_may_fetch(client: AsyncTestClient, demo: dict) -> None:
    digest = await loaded(client, demo["demo-short"])
    for url in (f"/v1/artifacts/{digest}", f"/v1/artifacts/{digest}/{WEIGHTS}"):
        assert (await client.get(url)).status_code == 401
        assert (await client.get(url, headers={"Authorization": "Bearer wrong"})).status_code == 401
        for headers in (reader(), admin(), {"Authorization": f"Bearer {ENGINE['e1']}"}):
            assert (await client.get(url, headers=headers)).status_code == 200, headers


async def test_a_blob_missing_from_the_store_is_an_error_not_a_short_file(client: AsyncTestClient, demo: dict,
                                                                          settings: ControlPlaneSettings) -> None:
    digest = await loaded(client, demo["demo-short"])
    data = files_of(demo["demo-short"])[WEIGHTS]
    (store_folder(settings) / "blobs" / sha(data)).unlink()  # lost behind the database's back
    r = await client.get(f"/v1/artifacts/{digest}/{WEIGHTS}", headers=reader())
    assert r.status_code == 500 and "missing from the artifact store" in r.json()["error"]["message"], r.text


async def test_an_s3_store_presigns_each_file(s3: S3, settings: ControlPlaneSettings, demo: dict) -> None:
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, artifact_store=s3.url))) as client:
        digest = await loaded(client, demo["demo-poet"])
        r = await client.get(f"/v1/artifacts/{digest}", headers={"Authorization": f"Bearer {ENGINE['e1']}"})
        assert r.status_code == 200, r.text
        manifest = msgspec.json.decode(r.content, type=ArtifactManifest)
        files = files_of(demo["demo-poet"])
        assert manifest_matches(manifest) and sorted(s3.keys()) == sorted(f"blobs/{sha(d)}" for d in files.values())
        for f in manifest.files:
            assert f.url is not None and f.url.startswith(s3.endpoint)
            assert httpx.get(f.url, timeout=10).content == files[f.name]  # no token: the URL is the grant
        ranged = await client.get(f"/v1/artifacts/{digest}/{WEIGHTS}", headers={**reader(), "Range": "bytes=5-9"})
        assert ranged.status_code == 206 and ranged.content == files[WEIGHTS][5:10]  # through the control plane too


async def test_an_unreachable_store_is_503_before_any_byte(s3: S3, settings: ControlPlaneSettings, demo: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    settings = dataclasses.replace(settings, artifact_store=s3.url)
    async with AsyncTestClient(app=create_app(settings)) as client:
        digest = await loaded(client, demo["demo-short"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # the store is down when the next one starts
    async with AsyncTestClient(app=create_app(settings)) as client:
        r = await client.get(f"/v1/artifacts/{digest}/{WEIGHTS}", headers=reader())
        assert r.status_code == 503 and "artifact store s3://artifacts/" in r.json()["error"]["message"], r.text
