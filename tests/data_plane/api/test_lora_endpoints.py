"""The LoRA endpoints and the adapter request path in process, over a real engine on the tiny demo
checkpoint (fast: no server process). Adapters are real PEFT folders read by the real loader. The
same behaviours against a real engine process over HTTP are in test_lora_api.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from data_plane.api.app import create_app
from data_plane.demo.adapters import write_demo_adapters
from data_plane.engine.async_engine import AsyncLLMEngine
from shared.errors import OverloadedError
from tests.data_plane.api.engines import SERVED, fail_batches_after, make_engine, refuse_admission
from tests.data_plane.api.test_app import assert_openai_error, sse_events

TOKEN = "s3cret-admin-token"
CHAT = "/v1/chat/completions"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def adapter_root(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fake_engine_adapters")
    write_demo_adapters(demo_model_dir, root)
    return root


def app_client(demo_model_dir: Path, root: Path, **config) -> TestClient:
    """An app over its own real engine: two device slots, adapters of rank <= 16 under `root`."""
    engine = make_engine(demo_model_dir, max_loras=2, max_cpu_loras=4, max_lora_rank=16, lora_roots=[str(root)],
                         **config)
    return TestClient(create_app(engine, engine.config), raise_server_exceptions=False)


@pytest.fixture
def client(demo_model_dir, adapter_root) -> Iterator[TestClient]:
    with app_client(demo_model_dir, adapter_root, enable_lora=True) as c:
        yield c


@pytest.fixture
def engine(client: TestClient) -> AsyncLLMEngine:
    return client.app.state.engine


def load(client: TestClient, root: Path, name: str, **fields):
    return client.post(LOAD, json={"lora_name": name, "lora_path": str(root / name), **fields})


def chat(client: TestClient, model: str, headers: dict[str, str] | None = None, **fields):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
            **fields}
    return client.post(CHAT, json=body, headers=headers or {})


def in_flight(client: TestClient) -> dict[str, int]:
    return {a["name"]: a["in_flight"] for a in client.get("/v1/lora_adapters").json()["adapters"]}


def test_lora_endpoints_without_enable_lora_are_400(demo_model_dir, adapter_root):
    with app_client(demo_model_dir, adapter_root) as client:
        for response in (
            load(client, adapter_root, "demo-poet"),
            client.post(UNLOAD, json={"lora_name": "demo-poet"}),
            client.get("/v1/lora_adapters"),
            client.get("/v1/lora_stats"),
        ):
            error = assert_openai_error(response, 400, "invalid_request_error")
            assert error["message"] == "LoRA is not enabled on this engine; start it with --enable-lora"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [SERVED]


def test_load_list_models_and_requests_carry_the_adapter(client, engine, adapter_root):
    r = load(client, adapter_root, "demo-poet")
    assert r.status_code == 200, r.text
    info = r.json()
    assert set(info) == {"name", "id", "version", "load_generation", "sha256", "rank", "alpha", "target_modules",
                         "size_bytes", "residency"}
    assert (info["version"], info["load_generation"]) == (None, 1)  # no registry version: loaded directly
    assert info["residency"] == "host" and info["rank"] == 16
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(SERVED, None), ("demo-poet", SERVED)]
    assert models[1]["root"] == str(adapter_root / "demo-poet")
    assert client.get("/v1/models/demo-poet").json() == models[1]
    assert models[1].get("version") is None and models[0].get("version") is None
    # a load that names the registry's version (the control plane's): listed as `version`, beside the
    # engine's own count of contents loaded under the name
    r = client.post(LOAD, json={"lora_name": "numbered", "lora_path": str(adapter_root / "demo-short"), "version": 7})
    assert r.status_code == 200 and (r.json()["version"], r.json()["load_generation"]) == (7, 1), r.text
    listed = {a["name"]: a for a in client.get("/v1/lora_adapters").json()["adapters"]}
    assert (listed["numbered"]["version"], listed["numbered"]["load_generation"]) == (7, 1)
    assert client.get("/v1/models/numbered").json()["version"] == 7
    assert client.post(LOAD, json={"lora_name": "numbered", "lora_path": str(adapter_root / "demo-short"),
                                   "version": 0}).status_code == 400
    assert client.post(UNLOAD, json={"lora_name": "numbered"}).status_code == 200

    # the base model first, twice: the second finds the prompt's blocks in the prefix cache
    base = [chat(client, SERVED, temperature=0, return_token_ids=True).json() for _ in range(2)]
    assert base[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    poet = chat(client, "demo-poet", temperature=0, return_token_ids=True).json()
    # the adapter ran: its weights were copied into a slot, its answer is its own, and its cache
    # namespace is not the base model's (the same prompt finds none of the base's blocks)
    assert engine.stats().lora.adapters[info["id"]].loads == 1
    assert poet["choices"][0]["token_ids"] != base[0]["choices"][0]["token_ids"]
    assert poet["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert base[0]["choices"][0]["token_ids"] == base[1]["choices"][0]["token_ids"]

    listing = client.get("/v1/lora_adapters").json()
    [adapter] = listing["adapters"]
    assert adapter["state"] == "ready" and adapter["pinned"] is False and adapter["in_flight"] == 0
    assert adapter["last_used_at"] >= adapter["loaded_at"]
    assert adapter["residency"] == "device"  # it stays in its slot after the request (LRU)
    assert listing["slots"] == {"used": 1, "total": 2}


def test_every_ending_releases_the_lease(client, engine, adapter_root, monkeypatch):
    load(client, adapter_root, "demo-short")
    assert chat(client, "demo-short").status_code == 200
    events = sse_events(chat(client, "demo-short", stream=True).text)
    assert events[-1] == "[DONE]"
    r = client.post("/v1/completions", json={"model": "demo-short", "prompt": ["a", "b", "c"], "max_tokens": 3})
    assert r.status_code == 200
    assert_openai_error(chat(client, "demo-short", max_tokens=10_000), 400)  # refused by the engine
    fail_batches_after(engine, monkeypatch, 1)
    assert_openai_error(chat(client, "demo-short"), 500)  # failed in the engine
    monkeypatch.undo()
    refuse_admission(engine, monkeypatch, OverloadedError("The server is overloaded."))
    assert_openai_error(chat(client, "demo-short"), 503)
    monkeypatch.undo()
    assert_openai_error(chat(client, "demo-short", n=0), 400)  # invalid request, before the engine
    assert in_flight(client) == {"demo-short": 0}


def test_unknown_adapter_is_404_and_no_label(client):
    error = assert_openai_error(chat(client, "no-such-adapter"), 404, "not_found_error")
    assert error["message"] == "The model `no-such-adapter` does not exist." and error["param"] == "model"
    r = client.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "x"})
    assert_openai_error(r, 404)
    assert_openai_error(client.get("/v1/models/no-such-adapter"), 404)
    metrics = client.get("/metrics").text
    assert "no-such-adapter" not in metrics
    assert 'loraplane_requests_total{adapter="",outcome="rejected"} 2.0' in metrics


def test_idempotent_load_conflict_and_unload(client, adapter_root, demo_model_dir, tmp_path):
    first = load(client, adapter_root, "demo-poet").json()
    assert load(client, adapter_root, "demo-poet").json() == first
    # other content under the same name (the demo-short files)
    other = client.post(LOAD, json={"lora_name": "demo-poet", "lora_path": str(adapter_root / "demo-short")})
    error = assert_openai_error(other, 409, "conflict_error")
    assert first["sha256"][:12] in error["message"]
    r = client.post(LOAD, json={"lora_name": "demo-poet", "lora_path": str(adapter_root / "demo-short"), "load_inplace": True})
    assert r.status_code == 200 and r.json()["id"] > first["id"] and r.json()["load_generation"] == 2
    assert client.post(UNLOAD, json={"lora_name": "demo-poet"}).json() == {
        "name": "demo-poet",
        "drained": True,
        "aborted": 0,
    }
    assert_openai_error(client.post(UNLOAD, json={"lora_name": "demo-poet"}), 404)
    assert_openai_error(chat(client, "demo-poet"), 404)
    assert client.get("/v1/lora_adapters").json()["adapters"] == []


def test_bad_bodies_and_refused_adapters_are_4xx(client, adapter_root, engine):
    assert_openai_error(client.post(LOAD, json={"lora_name": "x"}), 400)  # lora_path missing
    assert_openai_error(client.post(LOAD, content=b"{"), 400)
    assert_openai_error(client.post(LOAD, json={"lora_name": SERVED, "lora_path": str(adapter_root / "demo-poet")}),
                        400)
    error = assert_openai_error(load(client, adapter_root, "demo-pirate", lora_path="/etc"), 400)
    assert "outside the allowed LoRA roots" in error["message"]
    error = assert_openai_error(client.post(LOAD, json={"lora_name": "y", "lora_path": str(adapter_root / "nope")}), 400)
    assert "does not exist" in error["message"]
    assert_openai_error(client.post(UNLOAD, json={"lora_name": "demo-poet", "drain_timeout_s": -1}), 400)
    assert client.get("/v1/lora_adapters").json()["adapters"] == []
    assert load(client, adapter_root, "demo-poet").status_code == 200  # and the next load works


def test_pinned_load_takes_a_slot(client, adapter_root, engine):
    info = load(client, adapter_root, "demo-poet", pinned=True).json()
    assert info["residency"] == "device"
    held = engine.stats().lora.adapters[info["id"]]
    assert held.pinned and held.slot is not None and held.loads == 1
    assert client.get("/v1/lora_adapters").json()["slots"] == {"used": 1, "total": 2}
    client.post(UNLOAD, json={"lora_name": "demo-poet"})
    assert info["id"] not in engine.stats().lora.adapters and engine.stats().lora.slots_used == 0


def test_a_pinned_load_when_every_slot_is_pinned_is_409(client, adapter_root, engine):
    for name in ("demo-poet", "demo-short"):
        assert load(client, adapter_root, name, pinned=True).status_code == 200
    error = assert_openai_error(load(client, adapter_root, "demo-pirate", pinned=True), 409, "conflict_error")
    assert "--max-loras" in error["message"]
    assert [a["name"] for a in client.get("/v1/lora_adapters").json()["adapters"]] == ["demo-poet", "demo-short"]


@pytest.mark.parametrize(
    ("header", "status"),
    [(None, 401), ("Basic abc", 401), ("Bearer", 401), ("Bearer wrong", 403), (f"Bearer {TOKEN}", 200)],
)
def test_admin_token(demo_model_dir, adapter_root, caplog, header, status):
    caplog.set_level(logging.DEBUG)
    headers = {"Authorization": header} if header else {}
    with app_client(demo_model_dir, adapter_root, enable_lora=True, admin_token=TOKEN) as client:
        r = client.post(LOAD, json={"lora_name": "demo-poet", "lora_path": str(adapter_root / "demo-poet")}, headers=headers)
        assert r.status_code == status, r.text
        if status != 200:
            assert_openai_error(r, status)
        r = client.post(UNLOAD, json={"lora_name": "demo-poet"}, headers=headers)
        assert r.status_code == (status if status != 200 else 200), r.text
        assert client.get("/v1/lora_adapters").status_code == 401  # listings need a token too
        assert client.get("/v1/lora_stats", headers=headers).status_code == status
    assert TOKEN not in caplog.text


READ, KEY = "r3ad-token", "ap1-key"
_LISTINGS = ("/v1/lora_adapters", "/v1/lora_stats")
_MODELS = ("/v1/models", f"/v1/models/{SERVED}")


@pytest.mark.parametrize(
    ("offered", "listing", "models"),
    [(None, 401, 401), ("Basic abc", 401, 401), ("Bearer wrong", 403, 401), (f"Bearer {KEY}", 403, 200),
     (f"Bearer {READ}", 200, 200), (f"Bearer {TOKEN}", 200, 200)],
)
def test_the_listings_need_the_admin_or_read_token_and_models_also_the_api_key(
        demo_model_dir, adapter_root, caplog, offered, listing, models):
    """The engine's auth matrix with all three secrets: who may read what, and what else the read token
    opens (nothing)."""
    caplog.set_level(logging.DEBUG)
    headers = {"Authorization": offered} if offered else {}
    with app_client(demo_model_dir, adapter_root, enable_lora=True, admin_token=TOKEN, read_token=READ,
                    api_key=KEY) as client:
        for path in _LISTINGS:
            r = client.get(path, headers=headers)
            assert r.status_code == listing, (path, r.text)
            if listing != 200:
                error = assert_openai_error(r, listing)
                assert "--read-token or --admin-token" in error["message"] and "--api-key" not in error["message"]
        for path in _MODELS:
            r = client.get(path, headers=headers)
            assert r.status_code == models, (path, r.text)
            if models != 200:
                assert "--read-token or --admin-token, or its --api-key" in assert_openai_error(r, 401)["message"]
        chat_status = chat(client, SERVED, max_tokens=1, headers=headers).status_code
        assert chat_status == (200 if offered == f"Bearer {KEY}" else 401)  # the read token serves nothing
        r = client.post(UNLOAD, json={"lora_name": "demo-poet"}, headers=headers)
        assert r.status_code == (404 if offered == f"Bearer {TOKEN}" else 401 if listing == 401 else 403)
        doc = client.get("/schema/openapi.json").json()["paths"]
        assert {"401", "403"} <= set(doc["/v1/lora_adapters"]["get"]["responses"])
        assert "401" in doc["/v1/models"]["get"]["responses"]
    for secret in (TOKEN, READ, KEY):
        assert secret not in caplog.text


@pytest.mark.parametrize("config", [{}, {"api_key": KEY}])
def test_without_admin_or_read_token_the_listings_stay_open(demo_model_dir, adapter_root, config):
    with app_client(demo_model_dir, adapter_root, enable_lora=True, **config) as client:
        for path in _LISTINGS:
            assert client.get(path).status_code == 200
        assert client.get("/v1/models").status_code == (401 if config else 200)  # --api-key alone, as vLLM
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_stats_and_metrics_per_adapter_with_label_cap(demo_model_dir, adapter_root):
    with app_client(demo_model_dir, adapter_root, enable_lora=True, max_adapter_labels=1) as client:
        for name in ("demo-poet", "demo-short"):
            load(client, adapter_root, name)
            assert chat(client, name).status_code == 200
        assert chat(client, SERVED).status_code == 200
        metrics = client.get("/metrics").text
        assert 'loraplane_requests_total{adapter="demo-poet",outcome="ok"} 1.0' in metrics
        assert 'loraplane_requests_total{adapter="other",outcome="ok"} 1.0' in metrics  # past the cap
        assert f'loraplane_requests_total{{adapter="{SERVED}",outcome="ok"}} 1.0' in metrics  # base: always its own
        assert 'adapter="demo-short"' not in metrics
        stats = client.get("/v1/lora_stats").json()
        assert stats["base"]["requests"]["ok"] == 1
        by_name = {a["name"]: a for a in stats["adapters"]}
        assert set(by_name) == {"demo-poet", "demo-short"}
        poet = by_name["demo-poet"]
        assert poet["requests"]["ok"] == 1 and poet["generated_tokens"] == 4 and poet["prompt_tokens"] > 0
        assert poet["ttft_seconds"]["samples"] == 1 and poet["e2e_seconds"]["p99"] >= poet["ttft_seconds"]["p50"]
        assert poet["generated_tokens_per_second_1m"] > 0
        assert poet["loads"] == 1 and poet["evictions"] == 0 and poet["load_seconds"]["total"] > 0
        client.post(UNLOAD, json={"lora_name": "demo-poet"})
        assert [a["name"] for a in client.get("/v1/lora_stats").json()["adapters"]] == ["demo-short"]


@pytest.mark.parametrize("name", ["a\0b", "a\u202eb", "name\n", "../lora_stats", "a/../b", "a//b", "", "a" * 129])
def test_unsafe_adapter_names_are_400_naming_lora_name(client, adapter_root, name):
    r = client.post(LOAD, json={"lora_name": name, "lora_path": str(adapter_root / "demo-poet")})
    error = assert_openai_error(r, 400, "invalid_request_error")
    assert error["param"] == "lora_name" and "not a valid adapter name" in error["message"]
    assert_openai_error(client.post(UNLOAD, json={"lora_name": name}), 400)
    assert client.get("/v1/lora_adapters").json()["adapters"] == []


def test_the_base_models_name_is_refused_as_an_adapter_name(client, adapter_root):
    error = assert_openai_error(client.post(LOAD, json={"lora_name": SERVED, "lora_path": str(adapter_root / "demo-poet")}),
                                400)
    assert error["param"] == "lora_name" and "base model's name" in error["message"]
    assert client.get("/v1/lora_adapters").json()["adapters"] == []


@pytest.mark.parametrize("kind", ["nul", "long", "long-component", "unknown-user"])
def test_nul_or_overlong_paths_are_400_not_500(client, adapter_root, kind):
    path = {"nul": f"{adapter_root}/demo-poet\0x", "long": f"{adapter_root}/" + "a/" * 1000,
            "long-component": f"{adapter_root}/" + "a" * 2000,
            "unknown-user": "~nosuchuser-loraplane/x"}[kind]  # expanduser raises for an unknown user
    error = assert_openai_error(client.post(LOAD, json={"lora_name": "p", "lora_path": path}), 400)
    assert error["param"] == "lora_path"
    assert load(client, adapter_root, "demo-poet").status_code == 200  # and the engine is fine


def test_listings_show_paths_to_admin_callers_only(demo_model_dir, adapter_root):
    with app_client(demo_model_dir, adapter_root, enable_lora=True, admin_token=TOKEN, read_token=READ) as client:
        admin = {"Authorization": f"Bearer {TOKEN}"}
        assert load(client, adapter_root, "demo-poet", **{}).status_code == 401
        r = client.post(LOAD, json={"lora_name": "demo-poet", "lora_path": str(adapter_root / "demo-poet")},
                        headers=admin)
        assert r.status_code == 200, r.text
        for headers in ({"Authorization": f"Bearer {READ}"},):  # the read token sees no paths
            body = client.get("/v1/lora_adapters", headers=headers)
            assert body.status_code == 200 and str(adapter_root) not in body.text
            assert body.json()["adapters"][0]["path"] is None
            assert str(adapter_root) not in client.get("/v1/lora_stats", headers=headers).text
            models = client.get("/v1/models", headers=headers)  # vLLM's `root` is where the files lie
            assert models.status_code == 200 and str(adapter_root) not in models.text
            assert str(demo_model_dir) not in models.text
            assert {m["id"]: m["root"] for m in models.json()["data"]}["demo-poet"] == "demo-poet"
            assert client.get("/v1/models/demo-poet", headers=headers).json()["root"] == "demo-poet"
        [adapter] = client.get("/v1/lora_adapters", headers=admin).json()["adapters"]
        assert adapter["path"] == str(adapter_root / "demo-poet")
        roots = {m["id"]: m["root"] for m in client.get("/v1/models", headers=admin).json()["data"]}
        assert roots["demo-poet"] == str(adapter_root / "demo-poet")


def test_expected_sha256_refuses_other_content_and_loads_nothing(client, adapter_root):
    poet = adapter_root / "demo-poet"
    files = [poet / "adapter_config.json", poet / "adapter_model.safetensors"]
    from shared.manifest import files_digest

    digest = files_digest(files)
    other = files_digest([adapter_root / "demo-short" / f.name for f in files])
    error = assert_openai_error(load(client, adapter_root, "demo-poet", expected_sha256=other), 409, "conflict_error")
    assert error["code"] == "sha256_mismatch" and error["param"] == "expected_sha256"
    assert "adapter_config.json or its weights changed" in error["message"]
    assert other[:16] in error["message"] and digest[:16] in error["message"]
    assert client.get("/v1/lora_adapters").json()["adapters"] == []
    assert_openai_error(load(client, adapter_root, "demo-poet", expected_sha256="xyz"), 400)
    r = load(client, adapter_root, "demo-poet", expected_sha256=digest)
    assert r.status_code == 200 and r.json()["sha256"] == digest
    # the same name, now loaded: a mismatching re-declaration changes nothing either
    assert_openai_error(load(client, adapter_root, "demo-poet", expected_sha256=other, load_inplace=True), 409)
    [held] = client.get("/v1/lora_adapters").json()["adapters"]
    assert (held["sha256"], held["load_generation"]) == (digest, 1)


def test_the_lora_admin_routes_are_typed_and_every_status_is_documented(demo_model_dir, adapter_root):
    import msgspec

    from shared import engine_admin
    from shared.manifest import files_digest
    from shared.names import ADAPTER_NAME_PATTERN
    from shared.openapi import ErrorResponse

    admin = {"Authorization": f"Bearer {TOKEN}"}
    with app_client(demo_model_dir, adapter_root, enable_lora=True, admin_token=TOKEN) as client:
        doc = client.get("/schema/openapi.json").json()
        paths, components = doc["paths"], doc["components"]["schemas"]
        routes = {LOAD: "post", UNLOAD: "post", "/v1/lora_adapters": "get", "/v1/lora_stats": "get"}
        documented = {p: set(map(int, paths[p][m]["responses"])) for p, m in routes.items()}
        assert documented == {LOAD: {200, 400, 401, 403, 409, 413, 502, 503}, UNLOAD: {200, 400, 401, 403, 404, 413},
                              "/v1/lora_adapters": {200, 400, 401, 403}, "/v1/lora_stats": {200, 400, 401, 403}}
        refs = {p: paths[p][m]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/")[-1]
                for p, m in routes.items()}
        assert refs == {LOAD: "LoadedAdapter", UNLOAD: "UnloadedAdapter", "/v1/lora_adapters": "AdapterList",
                        "/v1/lora_stats": "LoraStats"}
        for p in (LOAD, UNLOAD):
            assert paths[p]["post"]["responses"]["409" if p == LOAD else "404"]["content"]["application/json"][
                "schema"]["$ref"].endswith("/ErrorResponse")
        load_req = components["LoadLoRAAdapterRequest"]["properties"]
        assert load_req["lora_name"]["pattern"] == ADAPTER_NAME_PATTERN
        lora_path = load_req["lora_path"]["anyOf"][0]  # optional: `artifact` names the files instead
        assert lora_path["maxLength"] == 4096 and lora_path["pattern"] == "^[^\\x00]*$"
        assert load_req["expected_sha256"]["anyOf"][0]["pattern"] == "^[0-9a-f]{64}$"
        assert components["UnloadLoRAAdapterRequest"]["properties"]["drain_timeout_s"]["anyOf"][0]["minimum"] == 0

        # every answer matches its documented schema, and every status seen is a documented one
        poet = adapter_root / "demo-poet"
        digest = files_digest([poet / "adapter_config.json", poet / "adapter_model.safetensors"])
        seen: dict[str, set[int]] = {p: set() for p in routes}

        def check(path: str, r, kind: type) -> None:
            seen[path].add(r.status_code)
            msgspec.json.decode(r.content, type=kind if r.status_code == 200 else ErrorResponse)

        body = {"lora_name": "demo-poet", "lora_path": str(poet)}
        check(LOAD, client.post(LOAD, json=body), engine_admin.LoadedAdapter)  # 401
        check(LOAD, client.post(LOAD, json=body, headers={"Authorization": "Bearer no"}), engine_admin.LoadedAdapter)
        check(LOAD, client.post(LOAD, json={**body, "lora_name": "a\n"}, headers=admin), engine_admin.LoadedAdapter)
        check(LOAD, client.post(LOAD, json={**body, "expected_sha256": "0" * 64}, headers=admin),
              engine_admin.LoadedAdapter)
        check(LOAD, client.post(LOAD, content=b"x" * 5000, headers=admin), engine_admin.LoadedAdapter)  # 413
        check(LOAD, client.post(LOAD, json={**body, "expected_sha256": digest, "pinned": True}, headers=admin),
              engine_admin.LoadedAdapter)
        for headers in (admin, {}, {"Authorization": "Bearer no"}):
            check("/v1/lora_adapters", client.get("/v1/lora_adapters", headers=headers), engine_admin.AdapterList)
            check("/v1/lora_stats", client.get("/v1/lora_stats", headers=headers), engine_admin.LoraStats)
        check(UNLOAD, client.post(UNLOAD, json={"lora_name": "nope"}, headers=admin), engine_admin.UnloadedAdapter)
        check(UNLOAD, client.post(UNLOAD, json={"lora_name": "demo-poet", "drain_timeout_s": -1}, headers=admin),
              engine_admin.UnloadedAdapter)
        check(UNLOAD, client.post(UNLOAD, json={"lora_name": "demo-poet"}, headers=admin),
              engine_admin.UnloadedAdapter)
        assert seen[LOAD] == {200, 400, 401, 403, 409, 413} and seen[UNLOAD] == {200, 400, 404}
        assert seen["/v1/lora_adapters"] == seen["/v1/lora_stats"] == {200, 401, 403}
        assert all(seen[p] <= documented[p] for p in routes)
    with app_client(demo_model_dir, adapter_root) as off:  # LoRA off: the documented 400
        for p in ("/v1/lora_adapters", "/v1/lora_stats"):
            assert_openai_error(off.get(p), 400)
