"""POST /v1/lora_adapters/{name}/versions: an upload becomes a version exactly as a load of the same folder
does (same digest), and a refused, oversized or interrupted one leaves nothing behind: no adapter, no
version, no blob row and no object in the store's folder (what lies on disk is listed, not assumed)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import socket
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from control_plane.settings import ControlPlaneSettings
from tests.control_plane.artifacts.helpers import (
    ADAPTERS,
    blob_rows,
    files_of,
    post_tarball,
    recorded,
    sha,
    stored_objects,
    tarball,
    upload,
)
from tests.control_plane.conftest import ADMIN, admin, reader
from tests.control_plane.domain.adapters.helpers import add_engines, audit
from tests.control_plane.engines import served_control_plane
from tests.e2e.test_control_plane_engines import _free_port as free_port

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


async def load(client: AsyncTestClient, name: str, folder: Path) -> dict:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(folder), "base_model": "demo"})
    assert r.status_code == 200, r.text
    return r.json()


async def test_multipart_and_tarball_record_the_version_a_load_records(client: AsyncTestClient, demo: dict,
                                                                      settings: ControlPlaneSettings) -> None:
    loaded = await load(client, "by-load", demo["demo-poet"])
    r = await upload(client, "by-form", demo["demo-poet"])
    assert r.status_code == 200, r.text
    by_form = r.json()
    files = files_of(demo["demo-poet"])
    r = await post_tarball(client, "by-tar", tarball({f"poet/{n}": data for n, data in files.items()}))
    assert r.status_code == 200, r.text
    by_tar = r.json()
    r = await post_tarball(client, "by-flat-tar", tarball(files))  # the files at the archive's top
    assert r.status_code == 200, r.text
    for body in (by_form, by_tar, r.json()):
        assert {k: body[k] for k in ("sha256", "rank", "alpha", "target_modules", "version", "created")} == {
            k: loaded[k] for k in ("sha256", "rank", "alpha", "target_modules", "version", "created")}
        assert body["engines"] == []
    again = await upload(client, "by-form", demo["demo-poet"])
    assert again.status_code == 200 and again.json()["version"] == 1 and again.json()["created"] is False
    detail = (await client.get(f"{ADAPTERS}/by-form", headers=reader())).json()
    assert detail["active_version"] == 1 and detail["versions"][0]["uri"] == "upload"
    assert [row for row in await audit(settings.database_url) if row[0] == "upload_lora_adapter"] == [
        ("upload_lora_adapter", name, "ok") for name in ("by-form", "by-tar", "by-flat-tar", "by-form")]
    # four adapters, one set of files: one blob per file, in the database and in the store
    assert await blob_rows(settings.database_url) == stored_objects(settings) == sorted(map(sha, files.values()))
    assert await recorded(settings.database_url) == (4, 4, 8, 2)


async def test_fields_description_pinned_and_activate_false(client: AsyncTestClient, demo: dict,
                                                            settings: ControlPlaneSettings) -> None:
    await add_engines(settings.database_url, ("e1", "demo", "healthy"))  # placed on, never answers
    r = await upload(client, "f", demo["demo-poet"], description="first", activate="false", pinned="true")
    assert r.status_code == 200 and r.json()["engines"] == [], r.text  # not activated: nothing pushed
    detail = (await client.get(f"{ADAPTERS}/f", headers=reader())).json()
    assert (detail["description"], detail["active_version"], detail["placements"]) == ("first", None, [])
    assert [v["number"] for v in detail["versions"]] == [1]
    r = await upload(client, "f", demo["demo-short"], pinned="true")  # activate defaults to true
    assert r.status_code == 502 and r.json()["version"] == 2, r.text  # e1 does not answer
    detail = (await client.get(f"{ADAPTERS}/f", headers=reader())).json()
    assert detail["active_version"] == 2 and detail["description"] == "first"
    assert [(p["engine"], p["version"], p["desired"]) for p in detail["placements"]] == [("e1", 2, "pinned")]
    r = await upload(client, "f", demo["demo-pirate"], activate="no")
    assert r.status_code == 200 and r.json()["version"] == 3, r.text
    assert (await client.get(f"{ADAPTERS}/f", headers=reader())).json()["active_version"] == 2
    bad = await upload(client, "f", demo["demo-pirate"], activate="maybe")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "activate", bad.text
    unknown = await client.post(f"{ADAPTERS}/g/versions", headers=admin(), data={"colour": "red"},
                                files=[("files", (CONFIG, files_of(demo["demo-poet"])[CONFIG]))])
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"], unknown.text


async def test_an_upload_needs_a_base_model_when_the_config_names_none(client: AsyncTestClient, demo: dict,
                                                                       tmp_path: Path) -> None:
    folder = tmp_path / "nameless"
    folder.mkdir()
    for name, data in files_of(demo["demo-poet"]).items():
        (folder / name).write_bytes(data.replace(b'"base_model_name_or_path"', b'"unused"') if name == CONFIG
                                    else data)
    r = await client.post(f"{ADAPTERS}/nameless/versions", headers=admin(),
                          files=[("files", (n, d)) for n, d in files_of(folder).items()])
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model", r.text


async def assert_nothing_recorded(settings: ControlPlaneSettings) -> None:
    assert await recorded(settings.database_url) == (0, 0, 0, 0)
    assert stored_objects(settings) == []


@pytest.fixture
def small_settings(settings: ControlPlaneSettings, demo: dict) -> ControlPlaneSettings:
    """A cap between the config's size and the whole adapter's."""
    return dataclasses.replace(settings, max_artifact_bytes=len(files_of(demo["demo-poet"])[CONFIG]) + 1000)


async def test_above_the_cap_is_413_and_nothing_is_recorded(small_settings: ControlPlaneSettings, demo: dict) -> None:
    from control_plane.app import create_app

    files = files_of(demo["demo-poet"])
    bomb = io.BytesIO()  # 512 KiB of weights in well under the cap: the cap counts what it expands to
    with tarfile.open(fileobj=bomb, mode="w:gz") as archive:
        info = tarfile.TarInfo(WEIGHTS)
        info.size = 512 << 10
        archive.addfile(info, io.BytesIO(b"\0" * info.size))
    assert len(bomb.getvalue()) < small_settings.max_artifact_bytes
    async with AsyncTestClient(app=create_app(small_settings)) as client:
        for r in (await upload(client, "big", demo["demo-poet"]),
                  await post_tarball(client, "big", tarball(files)),
                  await post_tarball(client, "big", bomb.getvalue())):
            assert r.status_code == 413, r.text
            assert "--max-artifact-bytes" in r.json()["error"]["message"], r.text
        r = await client.post("/v1/load_lora_adapter", headers=admin(),  # a load is capped the same way
                              json={"lora_name": "big", "lora_path": str(demo["demo-poet"]), "base_model": "demo"})
        assert r.status_code == 413, r.text
    await assert_nothing_recorded(small_settings)
    assert {o for a, t, o in await audit(small_settings.database_url)} == {"413 invalid_request_error"}


async def test_a_refusal_after_the_files_were_read_leaves_no_object(client: AsyncTestClient, demo: dict,
                                                                    settings: ControlPlaneSettings) -> None:
    """Base-model conflicts and a name that is a base model's are found once the files are in the
    store's reach: they must not stay there, listed by nothing."""
    await load(client, "owned", demo["demo-poet"])
    before = stored_objects(settings)
    conflict = await upload(client, "owned", demo["demo-short"], base_model="other")
    assert conflict.status_code == 409, conflict.text
    named = await upload(client, "demo", demo["demo-pirate"])
    assert named.status_code == 400 and named.json()["error"]["param"] == "lora_name", named.text
    assert stored_objects(settings) == before == await blob_rows(settings.database_url)


@pytest.mark.parametrize(("what", "renamed", "extra"), [
    ("an extra file", {}, {"README.md": b"hello"}),
    ("an escape", {}, {"../x": b"x"}),
    ("a parent path", {CONFIG: f"../{CONFIG}"}, {}),
    ("an absolute path", {CONFIG: f"/{CONFIG}"}, {}),
    ("two folders deep", {CONFIG: f"a/b/{CONFIG}", WEIGHTS: f"a/b/{WEIGHTS}"}, {}),
])
async def test_an_archive_with_anything_but_the_two_files_is_refused(
        client: AsyncTestClient, demo: dict, what: str, renamed: dict, extra: dict, settings: ControlPlaneSettings) -> None:
    members = {renamed.get(n, n): data for n, data in files_of(demo["demo-poet"]).items()}
    r = await post_tarball(client, "tar", tarball({**members, **extra}))
    assert r.status_code == 400, (what, r.text)
    assert r.json()["error"]["param"] == "file"
    await assert_nothing_recorded(settings)


async def test_archive_links_folders_and_garbage_are_refused(client: AsyncTestClient, demo: dict,
                                                             settings: ControlPlaneSettings) -> None:
    files = files_of(demo["demo-poet"])
    cases = {
        "a symlink": tarball({CONFIG: files[CONFIG]}, links={WEIGHTS: "/etc/passwd"}),
        "two folders": tarball({f"a/{CONFIG}": files[CONFIG], f"b/{WEIGHTS}": files[WEIGHTS]}),
        "a file twice": tarball({CONFIG: files[CONFIG], f"a/{CONFIG}": files[CONFIG], WEIGHTS: files[WEIGHTS]}),
        "no weights": tarball({CONFIG: files[CONFIG]}),
        "not an archive": b"\x1f\x8b" + b"garbage" * 100,
        "broken weights": tarball({CONFIG: files[CONFIG], WEIGHTS: files[WEIGHTS][:1000]}),
    }
    for what, body in cases.items():
        r = await post_tarball(client, "tar", body)
        assert r.status_code == 400, (what, r.text)
    await assert_nothing_recorded(settings)


async def test_multipart_refusals_name_their_cause(client: AsyncTestClient, demo: dict,
                                                   settings: ControlPlaneSettings) -> None:
    files = files_of(demo["demo-poet"])
    url = f"{ADAPTERS}/form/versions"
    cases = [
        ([("files", ("notes.txt", b"x"))], "notes.txt"),
        ([("files", (CONFIG, files[CONFIG])), ("files", (CONFIG, files[CONFIG]))], "twice"),
        ([("files", (CONFIG, files[CONFIG]))], "adapter_model.safetensors missing"),
    ]
    for parts, cause in cases:
        r = await client.post(url, headers=admin(), files=parts, data={"base_model": "demo"})
        assert r.status_code == 400 and cause in r.json()["error"]["message"], (cause, r.text)
    r = await client.post(url, headers={**admin(), "Content-Type": "application/json"}, content=b"{}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "content-type", r.text
    r = await client.post(url, headers={**admin(), "Content-Type": "multipart/form-data"}, content=b"--x--")
    assert r.status_code == 400 and "boundary" in r.json()["error"]["message"], r.text
    r = await client.post(url, headers={**admin(), "Content-Type": "multipart/form-data; boundary=b"},
                          content=b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a\"\r\n\r\nx")
    assert r.status_code == 400, r.text  # a body cut short: malformed
    assert (await client.post(url, headers=reader(), files=[("files", (CONFIG, b"{}"))])).status_code == 403
    await assert_nothing_recorded(settings)


@pytest.mark.parametrize("name", ["x/versions", "versions", "activate/x", "a/activate"])
async def test_names_with_a_route_segment_are_refused(client: AsyncTestClient, demo: dict, name: str,
                                                      settings: ControlPlaneSettings) -> None:
    r = await upload(client, name, demo["demo-poet"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    await assert_nothing_recorded(settings)


def spools(settings: ControlPlaneSettings) -> set[str]:
    return {p.name for p in Path(str(settings.data_dir), "spool").glob("p*/spool-*")}


async def test_a_client_that_disconnects_mid_upload_leaves_nothing(settings: ControlPlaneSettings, demo: dict) -> None:
    files = files_of(demo["demo-poet"])
    boundary = "cut-here"
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{n}"\r\n\r\n'.encode()
                    + data + b"\r\n" for n, data in files.items()) + f"--{boundary}--\r\n".encode()
    head = (f"POST {ADAPTERS}/cut/versions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    port = free_port()
    before = spools(settings)
    async with served_control_plane(settings, port) as cp:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + body[: len(body) * 2 // 3])  # the config and part of the weights
            await asyncio.sleep(0.3)  # the server is reading the body meanwhile
        deadline = time.monotonic() + 10
        while not [row for row in await audit(settings.database_url) if row[1] == "cut"]:
            assert time.monotonic() < deadline, "the interrupted upload was never finished by the server"
            await asyncio.sleep(0.05)
        while spools(settings) - before:  # its spool folder goes too (removed as the refused request unwinds)
            assert time.monotonic() < deadline, f"the interrupted upload's spool stayed: {spools(settings) - before}"
            await asyncio.sleep(0.05)
        await assert_nothing_recorded(settings)
        r = await upload(cp, "after", demo["demo-poet"])  # the control plane keeps serving uploads
        assert r.status_code == 200, r.text
    assert await audit(settings.database_url) == [  # a refusal, not an internal error
        ("upload_lora_adapter", "cut", "400 invalid_request_error"), ("upload_lora_adapter", "after", "ok")]


@pytest.mark.parametrize("name", ["bad name", ".hidden", "a!b", "x" * 200])
async def test_an_invalid_name_is_refused_as_a_name_not_as_replicas(client: AsyncTestClient, demo: dict, name: str,
                                                                    settings: ControlPlaneSettings) -> None:
    r = await upload(client, name, demo["demo-poet"])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "lora_name", r.text
    assert "replicas" not in error["message"] and "name" in error["message"], r.text
    r = await upload(client, "ok", demo["demo-poet"], replicas='{"min": -1}')  # a bad field names itself
    assert r.status_code == 400 and r.json()["error"]["param"] == "replicas", r.text
    await assert_nothing_recorded(settings)


async def test_a_field_given_twice_is_a_400(client: AsyncTestClient, demo: dict,
                                            settings: ControlPlaneSettings) -> None:
    parts = [("files", (n, data, "application/octet-stream")) for n, data in files_of(demo["demo-poet"]).items()]
    parts += [("base_model", (None, b"demo")), ("base_model", (None, b"other"))]
    r = await client.post(f"{ADAPTERS}/twice/versions", headers=admin(), files=parts)
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model", r.text
    assert "twice" in r.json()["error"]["message"], r.text
    r = await client.post(f"{ADAPTERS}/twice/versions", headers={**admin(), "Content-Type": "application/gzip"},
                          content=tarball(files_of(demo["demo-poet"])),
                          params=[("base_model", "demo"), ("base_model", "other")])
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model", r.text
    await assert_nothing_recorded(settings)


def _with_header(weights: bytes, edit: Callable[[dict], None], data_cut: int = 0) -> bytes:
    """The safetensors file with its header edited by `edit` and `data_cut` bytes taken off its data's end."""
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    data = weights[8 + n:]
    return len(raw).to_bytes(8, "little") + raw + data[:len(data) - data_cut]


def _overlap(header: dict) -> None:
    """The second tensor's data starts inside the first one's (its size unchanged)."""
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 2, end - 2]


@pytest.mark.parametrize(("case", "cause"), [("short", "past the end of the file's data"),
                                             ("overlap", "no gap or overlap")])
async def test_tensor_data_offsets_are_checked_at_upload(client: AsyncTestClient, demo: dict, case: str, cause: str,
                                                         settings: ControlPlaneSettings) -> None:
    """The data, not only the header: data cut short, or two tensors' bytes overlapping, is a 400 naming
    the tensor before anything is recorded (an engine would refuse it, or read wrong weights)."""
    files = files_of(demo["demo-poet"])
    weights = (_with_header(files[WEIGHTS], lambda h: None, data_cut=4) if case == "short"
               else _with_header(files[WEIGHTS], _overlap))
    parts = [("files", (CONFIG, files[CONFIG], "application/json")),
             ("files", (WEIGHTS, weights, "application/octet-stream"))]
    r = await client.post(f"{ADAPTERS}/offsets/versions", headers=admin(), files=parts, data={"base_model": "demo"})
    assert r.status_code == 400 and cause in r.json()["error"]["message"], r.text
    assert "tensor " in r.json()["error"]["message"], r.text
    await assert_nothing_recorded(settings)
