"""POST /v1/load_lora_adapter: validation first, versions by content, idempotence under concurrency."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient
from safetensors import SafetensorError, safe_open

from control_plane.app import create_app
from control_plane.settings import ControlPlaneSettings
from control_plane.uow import Mutation
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import (
    add_engines,
    audit,
    bad_spans,
    broken_copy,
    fresh_copy,
    versions,
)


def load_body(name: str, path: Path, **extra: object) -> dict:
    return {"lora_name": name, "lora_path": str(path), "base_model": "demo", **extra}


async def test_load_registers_version_one_and_pins_it(client: AsyncTestClient, demo: dict, settings) -> None:
    r = await client.post("/v1/load_lora_adapter", json=load_body("org/pirate", demo["demo-pirate"]), headers=admin())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "org/pirate" and body["version"] == 1 and body["created"] is True
    assert (body["rank"], body["alpha"], body["engines"]) == (8, 16.0, [])
    assert body["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(body["sha256"]) == 64
    detail = (await client.get("/v1/lora_adapters/org/pirate", headers=reader())).json()
    assert detail["active_version"] == 1 and detail["base_model"] == "demo"
    assert [v["number"] for v in detail["versions"]] == [1] and detail["placements"] == []
    assert await audit(settings.database_url) == [("load_lora_adapter", "org/pirate", "ok")]


async def test_identical_files_reuse_the_version_new_files_add_one(client: AsyncTestClient, demo: dict,
                                                                   settings) -> None:
    first = await client.post("/v1/load_lora_adapter", json=load_body("a", demo["demo-pirate"]), headers=admin())
    again = await client.post("/v1/load_lora_adapter", json=load_body("a", demo["demo-pirate"]), headers=admin())
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["sha256"] == first.json()["sha256"] and again.json()["version"] == 1
    new = await client.post("/v1/load_lora_adapter", json=load_body("a", demo["demo-poet"]), headers=admin())
    assert new.json()["version"] == 2 and new.json()["created"] is True and new.json()["rank"] == 16
    assert [v.number for v in await versions(settings.database_url)] == [1, 2]
    detail = (await client.get("/v1/lora_adapters/a", headers=reader())).json()
    assert detail["active_version"] == 2


async def test_base_model_defaults_to_the_adapter_config_and_cannot_change(client: AsyncTestClient,
                                                                         demo: dict) -> None:
    body = {"lora_name": "p", "lora_path": str(demo["demo-pirate"])}
    assert (await client.post("/v1/load_lora_adapter", json=body, headers=admin())).status_code == 200
    detail = (await client.get("/v1/lora_adapters/p", headers=reader())).json()
    assert detail["base_model"] == str(demo["base"])
    r = await client.post("/v1/load_lora_adapter", json={**body, "base_model": "other"}, headers=admin())
    assert r.status_code == 409 and r.json()["error"]["param"] == "base_model"
    # the refusal says how to recover: re-target it (the exact command), or another name
    assert "loraplane adapters update p --base-model other" in r.json()["error"]["message"], r.text


async def test_twenty_concurrent_identical_loads_make_one_version(
        concurrent_client: httpx.AsyncClient, demo: dict, settings, monkeypatch: pytest.MonkeyPatch) -> None:
    client = concurrent_client
    inside, peak = 0, 0
    original = Mutation._transact

    async def counting(self, *args):  # noqa: ANN001, ANN202
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        try:
            return await original(self, *args)
        finally:
            inside -= 1

    monkeypatch.setattr(Mutation, "_transact", counting)
    body = load_body("storm", demo["demo-short"])
    answers = await asyncio.gather(*(client.post("/v1/load_lora_adapter", json=body, headers=admin())
                                     for _ in range(20)))
    assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers if a.status_code != 200]
    assert {a.json()["version"] for a in answers} == {1}
    assert sum(a.json()["created"] for a in answers) == 1
    assert len(await versions(settings.database_url)) == 1
    page = (await client.get("/v1/lora_adapters", headers=reader())).json()
    assert page["total"] == 1 and page["data"][0]["active_version"] == 1
    assert len(await audit(settings.database_url)) == 20
    assert peak > 1  # the calls really overlapped


async def test_concurrent_loads_of_different_files_number_versions_without_gaps(
        concurrent_client: httpx.AsyncClient, demo: dict, settings) -> None:
    files = [demo["demo-pirate"], demo["demo-poet"], demo["demo-short"]] * 3
    answers = await asyncio.gather(*(concurrent_client.post(
        "/v1/load_lora_adapter", json=load_body("mixed", f), headers=admin()) for f in files))
    assert [a.status_code for a in answers] == [200] * 9, [a.text for a in answers if a.status_code != 200]
    stored = await versions(settings.database_url)
    assert sorted(v.number for v in stored) == [1, 2, 3] and len({v.sha256 for v in stored}) == 3
    by_sha = {v.sha256: v.number for v in stored}
    assert all(by_sha[a.json()["sha256"]] == a.json()["version"] for a in answers)


BROKEN = ["no-weights", "truncated", "garbage-header", "not-lora", "dora", "rank-mismatch", "fewer-targets",
          "bad-json", "overlap", "short-span", "header-huge-integer", "header-deep-nesting", "config-huge-integer",
          "config-deep-nesting"]


@pytest.mark.parametrize("kind", BROKEN)
async def test_a_bad_adapter_is_refused_and_nothing_is_recorded(client: AsyncTestClient, demo: dict,
                                                                settings, kind: str) -> None:
    path = broken_copy(demo["demo-pirate"], demo["root"], kind)
    r = await client.post("/v1/load_lora_adapter", json=load_body("bad", path), headers=admin())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert (await client.get("/v1/lora_adapters", headers=reader())).json()["total"] == 0
    assert await versions(settings.database_url) == []
    assert await audit(settings.database_url) == [("load_lora_adapter", "bad", "400 invalid_request_error")]


@pytest.mark.parametrize("kind", ["overlap", "short-span"])
async def test_tensors_whose_data_is_not_theirs_are_refused_naming_the_tensor(
        client: AsyncTestClient, demo: dict, settings, kind: str) -> None:
    """Every tensor lies inside the file, but its bytes overlap another's or are fewer than its shape
    needs: safetensors, which the engine reads with, refuses the file; so does the load, before any record."""
    path = fresh_copy(demo["demo-pirate"], demo["root"], kind)
    tensor = bad_spans(path / "adapter_model.safetensors", kind)
    with pytest.raises(SafetensorError):  # the oracle: the engine's reader
        safe_open(str(path / "adapter_model.safetensors"), framework="pt")
    r = await client.post("/v1/load_lora_adapter", json=load_body("bad", path), headers=admin())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "lora_path")
    assert f"tensor {tensor}" in error["message"] and "adapter_model.safetensors" in error["message"], error
    assert await versions(settings.database_url) == []


async def test_paths_outside_the_roots_are_refused_without_saying_whether_they_exist(
        client: AsyncTestClient, tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "missing", "/etc"):
        r = await client.post("/v1/load_lora_adapter", json=load_body("x", path), headers=admin())
        assert r.status_code == 400 and "outside the allowed adapter roots" in r.json()["error"]["message"]


async def test_restart_on_the_same_sqlite_file_loses_nothing(demo: dict, tmp_path: Path) -> None:
    settings = ControlPlaneSettings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", admin_tokens=("adm1n-tok",),
                                    adapter_roots=(str(demo["root"]),))
    headers = {"Authorization": "Bearer adm1n-tok"}
    async with AsyncTestClient(app=create_app(settings)) as first:
        for name, path in (("a", demo["demo-pirate"]), ("a", demo["demo-poet"]), ("b", demo["demo-short"])):
            assert (await first.post("/v1/load_lora_adapter", json=load_body(name, path), headers=headers)).is_success
        await first.post("/v1/lora_adapters/a/activate", json={"version": 1}, headers=headers)
        before = (await first.get("/v1/lora_adapters/a", headers=headers)).json()
    async with AsyncTestClient(app=create_app(settings)) as second:
        assert (await second.get("/v1/lora_adapters/a", headers=headers)).json() == before
        assert (await second.get("/v1/lora_adapters", headers=headers)).json()["total"] == 2
    assert before["active_version"] == 1 and len(before["versions"]) == 2


@pytest.mark.parametrize("name", ["name\n", "a\0b", "a\u202eb", "../lora_stats", "a/../b", "a//b", "/a", ""])
async def test_unsafe_names_are_refused_naming_lora_name(client: AsyncTestClient, demo: dict, name: str) -> None:
    r = await client.post("/v1/load_lora_adapter", json=load_body(name, demo["demo-short"]), headers=admin())
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    message = r.json()["error"]["message"]
    assert "regex" not in message and ("letters, digits" in message or "length" in message), message
    assert (await client.get("/v1/lora_adapters", headers=reader())).json()["total"] == 0


async def test_a_base_models_name_is_refused_before_anything_is_recorded(client: AsyncTestClient, demo: dict,
                                                                         settings) -> None:
    await add_engines(settings.database_url, ("e1", "served-base", "healthy"))
    for name in ("demo", "served-base"):  # the adapter's own base model; a base model an engine serves
        r = await client.post("/v1/load_lora_adapter", json=load_body(name, demo["demo-short"]), headers=admin())
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "lora_name" and "base model" in r.json()["error"]["message"]
    assert await versions(settings.database_url) == []
    assert (await client.get("/v1/lora_adapters", headers=reader())).json()["total"] == 0


@pytest.mark.parametrize("kind", ["nul", "2000-characters", "long-component", "unknown-user"])
async def test_nul_or_overlong_paths_are_400(client: AsyncTestClient, demo: dict, kind: str) -> None:
    path = {"nul": f"{demo['demo-short']}\0x", "2000-characters": f"{demo['root']}/" + "a/" * 1000,
            "long-component": f"{demo['root']}/" + "a" * 300,
            "unknown-user": "~nosuchuser-loraplane/x"}[kind]
    r = await client.post("/v1/load_lora_adapter", json=load_body("p", path), headers=admin())
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


@pytest.mark.parametrize(("labels", "ok"), [
    ({f"k{i}": "v" for i in range(64)}, True), ({f"k{i}": "v" for i in range(65)}, False),
    ({"k" * 63: "v" * 256}, True), ({"k" * 64: "v"}, False), ({"k": "v" * 257}, False), ({"": "v"}, False)])
async def test_labels_are_bounded_in_number_and_size(client: AsyncTestClient, demo: dict, labels: dict,
                                                     ok: bool) -> None:
    r = await client.post("/v1/load_lora_adapter", json=load_body("l", demo["demo-short"], labels=labels),
                          headers=admin())
    assert r.status_code == (200 if ok else 400), r.text
    if not ok:
        assert r.json()["error"]["param"].startswith("labels")


async def test_the_openapi_document_states_the_name_label_and_path_rules(client: AsyncTestClient) -> None:
    from shared.names import ADAPTER_NAME_PATTERN

    schemas = (await client.get("/schema/openapi.json")).json()["components"]["schemas"]
    create = next(s for n, s in schemas.items() if n.endswith("AdapterCreate"))["properties"]
    assert create["lora_name"]["pattern"] == ADAPTER_NAME_PATTERN
    assert create["lora_path"]["maxLength"] == 1024 and "pattern" in create["lora_path"]
    assert "at most 64 labels" in create["labels"]["description"]
    # Litestar's generator keeps only the description of a dict's bounds; msgspec's own schema (what
    # validation enforces) has them all.
    import msgspec

    from control_plane.domain.adapters.schemas import AdapterCreate

    (_, defs) = msgspec.json.schema_components([AdapterCreate])
    labels = next(s for s in defs["AdapterCreate"]["properties"]["labels"]["anyOf"] if s.get("type") == "object")
    assert labels["maxProperties"] == 64
    assert labels["propertyNames"] == {"minLength": 1, "maxLength": 63}
    assert labels["additionalProperties"] == {"type": "string", "maxLength": 256}


async def test_named_engines_and_label_filters_are_bounded(client: AsyncTestClient, demo: dict) -> None:
    for engines in (["a\n"], ["../x"], [f"e{i}" for i in range(1025)]):
        r = await client.post("/v1/load_lora_adapter", json=load_body("n", demo["demo-short"], engines=engines),
                              headers=admin())
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("engines"), r.text
    r = await client.get("/v1/lora_adapters", params={"label": [f"k{i}" for i in range(65)]}, headers=reader())
    assert r.status_code == 400, r.text
    assert (await client.get("/v1/lora_adapters", params={"label": ["k"] * 64}, headers=reader())).status_code == 200
