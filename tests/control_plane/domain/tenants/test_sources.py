"""Where a tenant key with admin:<tenant> may load from, on both databases: nowhere but its own uploads
until an operator sets the tenant's `sources`, then only under them (paths resolved, and still under
--lora-roots). Another tenant's server path, or its digest in any spelling, gets a 403 that says what the
operator must set and is the same whether or not anything lies there; nothing is read or recorded.
Uploading another tenant's exact bytes works (the uploader has them) and yields a version of its own:
the other tenant's version, blobs and artifacts stay out of its reach, and its deletions leave them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from control_plane.db.models import Adapter, AdapterVersion, AuditEvent
from control_plane.settings import ControlPlaneSettings
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.control_plane.artifacts.helpers import files_of, sha
from tests.control_plane.conftest import ADMIN, KEY_PEPPER, READ, admin, reader
from tests.control_plane.domain.adapters.helpers import fetch_all
from tests.control_plane.domain.tenants.helpers import bearer, make_key, make_tenant

LOAD = "/v1/load_lora_adapter"
ADAPTERS = "/v1/lora_adapters"


@pytest.fixture
def roots(tmp_path: Path, demo: dict[str, Path]) -> Path:
    """--lora-roots: team-a's folder, team-b's private adapter, a sibling whose name starts like team-a's."""
    root = tmp_path / "roots"
    shutil.copytree(demo["demo-poet"], root / "team-a" / "mine")
    shutil.copytree(demo["demo-pirate"], root / "team-b" / "private")
    shutil.copytree(demo["demo-pirate"], root / "team-ab" / "x")
    return root


@pytest.fixture
def settings(db_url: str, roots: Path, tmp_path: Path) -> ControlPlaneSettings:
    return ControlPlaneSettings(database_url=db_url, admin_tokens=(ADMIN,), read_tokens=(READ,),
                                adapter_roots=(str(roots),), artifact_store=(tmp_path / "artifacts").as_uri(),
                                key_pepper=KEY_PEPPER)


def load_body(name: str, lora_path: str) -> dict:
    return {"lora_name": name, "lora_path": lora_path, "base_model": "demo"}


async def team_b_private(client: AsyncTestClient, lora_path: str) -> dict:
    """team-b's private adapter, loaded by the operator and given to team-b."""
    r = await client.post(LOAD, json=load_body("b-private", lora_path), headers=admin())
    assert r.status_code == 200, r.text
    moved = await client.put("/v1/tenancy/adapters/b-private", json={"owner": "team-b", "public": False},
                             headers=admin())
    assert moved.status_code == 200, moved.text
    return r.json()


def upload_parts(folder: Path) -> list:
    return [("files", (n, data, "application/octet-stream")) for n, data in files_of(folder).items()]


async def test_a_tenant_key_cannot_load_another_tenants_path_url_or_digest(client: AsyncTestClient, roots: Path,
                                                                          db_url: str) -> None:
    await make_tenant(client, "team-a")
    await make_tenant(client, "team-b")
    a_admin = bearer(await make_key(client, "team-a", "admin:team-a"))
    private = roots / "team-b" / "private"
    b = await team_b_private(client, str(private))
    digest = b["sha256"]

    refused = await client.post(LOAD, json=load_body("a-copy", str(private)), headers=a_admin)
    assert refused.status_code == 403, refused.text  # it was 200 with team-b's digest
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == "lora_path"
    assert "no sources" in error["message"] and "loraplane tenants update team-a --source" in error["message"]
    assert "/v1/lora_adapters/{name}/versions" in error["message"]  # what the key may do instead
    # the same answer, word for word, whether something lies there, nothing does, or it names the digest
    for lora_path in (private.as_uri(), str(roots / "team-a" / ".." / "team-b" / "private"),
                      str(roots / "team-b" / "nothing-here"), "/no/such/folder", digest, f"sha256:{digest}",
                      f"/v1/artifacts/{digest}", "s3://team-b-bucket/private/", "hf://team-b/private",
                      "gs://team-b/private", "az://team-b/private"):
        r = await client.post(LOAD, json=load_body("a-copy", lora_path), headers=a_admin)
        assert (r.status_code, r.json()) == (403, refused.json()), lora_path
    assert (await client.get(f"{ADAPTERS}/a-copy", headers=admin())).status_code == 404
    assert [v.sha256 for v in await fetch_all(db_url, AdapterVersion)] == [digest]
    refusals = [e for e in await fetch_all(db_url, AuditEvent) if e.target == "a-copy"]
    assert refusals and {(e.action, e.outcome) for e in refusals} == {("load_lora_adapter", "403 permission_error")}
    # its key cannot give itself a source, nor make a tenant; an admin token keeps loading anything
    r = await client.patch("/v1/tenants/team-a", json={"sources": [str(roots)]}, headers=a_admin)
    assert r.status_code == 403, r.text
    assert (await client.patch("/v1/tenants/team-a", json={"sources": [str(roots)]}, headers=reader())).status_code == 403
    assert (await client.get("/v1/tenants/team-a", headers=a_admin)).json()["sources"] == []
    r = await client.post(LOAD, json=load_body("operator-copy", str(private)), headers=admin())
    assert r.status_code == 200 and r.json()["sha256"] == digest, r.text


async def test_sources_are_set_by_an_operator_and_shown_as_compared(client: AsyncTestClient, roots: Path) -> None:
    made = await make_tenant(client, "team-a", sources=[f"{roots}/team-a/", (roots / "team-a").as_uri(),
                                                        "s3://Models/team-a/", "hf://org/poet@v2"])
    assert made["sources"] == [str(roots / "team-a"), "s3://models/team-a", "hf://org/poet@v2"]
    a_admin = bearer(await make_key(client, "team-a", "admin:team-a"))
    assert (await client.get("/v1/tenants/team-a", headers=a_admin)).json()["sources"] == made["sources"]
    r = await client.patch("/v1/tenants/team-a", json={"display_name": "A"}, headers=admin())
    assert r.json()["sources"] == made["sources"]  # left out: kept
    r = await client.patch("/v1/tenants/team-a", json={"sources": ["gs://b/x"]}, headers=admin())
    assert r.status_code == 200 and r.json()["sources"] == ["gs://b/x"], r.text  # given: replaced
    listed = (await client.get("/v1/tenants", headers=reader())).json()["data"]
    assert [t["sources"] for t in listed] == [["gs://b/x"]]
    for bad in ("relative/path", "~/adapters", "ftp://host/x", "file://elsewhere/x", "/srv/../etc", "s3://b/a/../c",
                "s3://b/a%2F..%2Fc", "s3://b/a//c", "s3://key:secret@b/x", "s3://b/x?versionId=1", "s3://b/x#y",
                "s3:///x", "s3://[b/x", "file://[x/y", "hf://org/a/b", "hf://org/@v1", "hf://org/x@a/b"):
        r = await client.patch("/v1/tenants/team-a", json={"sources": [bad]}, headers=admin())
        assert r.status_code == 400 and r.json()["error"]["param"] == "sources", (bad, r.text)
        assert "secret" not in r.text
    many = [f"/srv/{i}" for i in range(33)]
    assert (await client.post("/v1/tenants", json={"name": "team-c", "sources": many}, headers=admin())).status_code == 400
    assert (await client.get("/v1/tenants/team-a", headers=admin())).json()["sources"] == ["gs://b/x"]


async def test_a_tenant_key_loads_only_under_its_sources_and_the_roots(client: AsyncTestClient, roots: Path,
                                                                       tmp_path: Path, demo: dict[str, Path]) -> None:
    elsewhere = tmp_path / "elsewhere"  # a source outside --lora-roots
    shutil.copytree(demo["demo-short"], elsewhere / "short")
    await make_tenant(client, "team-a", sources=[str(roots / "team-a"), str(elsewhere)])
    await make_tenant(client, "team-b")
    a_admin = bearer(await make_key(client, "team-a", "admin:team-a"))
    private = roots / "team-b" / "private"
    await team_b_private(client, str(private))
    (roots / "team-a" / "link").symlink_to(private, target_is_directory=True)
    mixed = roots / "team-a" / "mixed"  # its own config, team-b's weights through a link
    mixed.mkdir()
    shutil.copy(private / CONFIG_NAME, mixed / CONFIG_NAME)
    (mixed / WEIGHTS_NAME).symlink_to(private / WEIGHTS_NAME)

    mine = await client.post(LOAD, json=load_body("a-mine", str(roots / "team-a" / "mine")), headers=a_admin)
    assert mine.status_code == 200 and mine.json()["created"], mine.text
    as_url = await client.post(LOAD, json=load_body("a-mine", (roots / "team-a" / "mine").as_uri()), headers=a_admin)
    assert as_url.status_code == 200 and as_url.json()["sha256"] == mine.json()["sha256"], as_url.text
    owned = (await client.get("/v1/tenants/team-a/adapters", headers=a_admin)).json()["adapters"]
    assert owned == [{"name": "a-mine", "owner": "team-a", "public": False}]

    outside = None
    for lora_path in (str(roots / "team-a" / ".." / "team-b" / "private"), str(roots / "team-ab" / "x"),
                      str(roots / "team-a" / "link"), str(roots / "team-a" / "link" / ".." / "private"),
                      str(roots), "s3://bucket/team-a/"):
        r = await client.post(LOAD, json=load_body("a-copy", lora_path), headers=a_admin)
        assert r.status_code == 403, (lora_path, r.text)
        assert outside is None or r.json() == outside
        outside = r.json()
        assert "not under any source of tenant 'team-a'" in r.json()["error"]["message"]
    # a file of a folder under its source that leads out of it: refused before it is read
    r = await client.post(LOAD, json=load_body("a-copy", str(mixed)), headers=a_admin)
    assert r.status_code == 400 and "outside the allowed adapter roots" in r.json()["error"]["message"], r.text
    # under its source but not under the operator's --lora-roots: refused as every load there is
    r = await client.post(LOAD, json=load_body("a-short", str(elsewhere / "short")), headers=a_admin)
    assert r.status_code == 400 and "outside the allowed adapter roots" in r.json()["error"]["message"], r.text
    assert (await client.get(f"{ADAPTERS}/a-copy", headers=admin())).status_code == 404


async def test_another_tenants_bytes_uploaded_give_only_a_version_of_ones_own(client: AsyncTestClient, roots: Path,
                                                                              settings: ControlPlaneSettings,
                                                                              db_url: str) -> None:
    await make_tenant(client, "team-a")
    await make_tenant(client, "team-b")
    a_admin = bearer(await make_key(client, "team-a", "admin:team-a"))
    b_admin = bearer(await make_key(client, "team-b", "admin:team-b"))
    private = roots / "team-b" / "private"
    b = await client.post(f"{ADAPTERS}/b-private/versions", files=upload_parts(private), data={"base_model": "demo"},
                          headers=b_admin)
    assert b.status_code == 200, b.text
    digest, weights_sha = b.json()["sha256"], sha(files_of(private)[WEIGHTS_NAME])
    blob = Path(settings.artifact_store.removeprefix("file://")) / "blobs" / weights_sha
    written = blob.stat().st_ino

    # team-a sends exactly team-b's files: it owns those bytes, so that works, and yields its own version
    a = await client.post(f"{ADAPTERS}/a-same/versions", files=upload_parts(private), data={"base_model": "demo"},
                          headers=a_admin)
    assert a.status_code == 200, a.text
    assert a.json()["sha256"] == digest and a.json()["version"] == 1 and a.json()["created"] is True
    assert blob.stat().st_ino != written  # written again as if new: the upload takes the same work either way
    mine = (await client.get(f"{ADAPTERS}/a-same", headers=a_admin)).json()
    assert [(v["number"], v["uri"], v["created_by"]) for v in mine["versions"]] == [
        (1, "upload", "tenant:team-a/k")]
    rows = {v.adapter_id: v for v in await fetch_all(db_url, AdapterVersion)}
    owners = {ad.name: ad.id for ad in await fetch_all(db_url, Adapter)}
    assert rows[owners["a-same"]].id != rows[owners["b-private"]].id  # no version row is shared

    # team-b's adapter, version and artifacts: as if they did not exist, whatever team-a knows
    missing = "0" * 64
    for path in (f"/v1/artifacts/{digest}", f"/v1/artifacts/{digest}/{WEIGHTS_NAME}"):
        r = await client.get(path, headers=a_admin)
        absent = await client.get(path.replace(digest, missing), headers=a_admin)
        assert (r.status_code, r.json()) == (absent.status_code, absent.json()) and r.status_code == 403, r.text
    for call in (lambda n: client.get(f"{ADAPTERS}/{n}", headers=a_admin),
                 lambda n: client.post(f"{ADAPTERS}/{n}/activate", json={"version": 1}, headers=a_admin),
                 lambda n: client.delete(f"{ADAPTERS}/{n}/versions/1", headers=a_admin)):
        theirs, nothing = await call("b-private"), await call("no-such-adapter")
        assert theirs.status_code == nothing.status_code == 404
        assert theirs.json()["error"]["message"].replace("b-private", "X") == \
            nothing.json()["error"]["message"].replace("no-such-adapter", "X")

    # team-a removing its copy leaves team-b's bytes where they were
    assert (await client.delete(f"{ADAPTERS}/a-same", headers=a_admin)).status_code == 200
    served = await client.get(f"/v1/artifacts/{digest}/{WEIGHTS_NAME}", headers=admin())
    assert served.status_code == 200 and sha(served.content) == weights_sha
    detail = (await client.get(f"{ADAPTERS}/b-private", headers=b_admin)).json()
    assert [(v["number"], v["sha256"]) for v in detail["versions"]] == [(1, digest)]
