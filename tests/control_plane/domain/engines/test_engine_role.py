"""The engine role (LORAPLANE_ENGINE_CREDENTIALS), engine URL checks, honest heartbeats and draining.

SSRF: an engine URL is where the control plane sends its engine admin token and every
load body (and an inference URL where routers send the engines' inference key and clients' requests), so
registration refuses URLs that reach elsewhere; and an engine holds only a token bound
to its own name, which can do an engine's bookkeeping and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from control_plane.settings import ControlPlaneSettings
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import audit

ENGINES = "/v1/engines"
E1_TOKEN, E2_TOKEN = "engine-one-token", "engine-two-token"


def as_engine(token: str = E1_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def spec(name: str = "e1", url: str = "http://127.0.0.1:1") -> dict:
    return {"name": name, "url": url, "base_model": "demo", "slots_total": 4}


@pytest.fixture
def role_settings(settings: ControlPlaneSettings) -> ControlPlaneSettings:
    return dataclasses.replace(settings, engine_credentials={"e1": E1_TOKEN, "e2": E2_TOKEN})


@pytest.fixture
async def cp(role_settings: ControlPlaneSettings) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(app=create_app(role_settings)) as c:
        yield c


ATTACKS = {
    "http://127.0.0.1:8000/?x=": "query",
    "http://127.0.0.1:8000?x=1": "query",
    "http://127.0.0.1:8000/#frag": "fragment",
    "http://127.0.0.1:8000/v1/evil": "path",
    "http://user:pw@127.0.0.1:8000": "userinfo",
    "http://admin@127.0.0.1:8000": "userinfo",
    "http://0x7f.1:8000": "unusual spelling",
    "http://2130706433:8000": "unusual spelling",
    "http://127.1:8000": "unusual spelling",
    "http://0177.0.0.1:8000": "unusual spelling",
    "http://169.254.169.254": "cloud metadata address",
    "http://169.254.10.1:80": "link-local",
    "http://[fe80::1]:8000": "link-local",
    "http://[::ffff:169.254.169.254]": "cloud metadata address",
    "http://[fd00:ec2::254]": "cloud metadata address",
    # IPv6 spellings that reach an IPv4 address through a translator or tunnel
    "http://[64:ff9b::a9fe:a9fe]": "embeds 169.254.169.254 is a cloud metadata address",  # NAT64
    "http://[64:ff9b:1:a9fe:a9:fe00::]:80": "embeds 169.254.169.254",  # local NAT64, /48 layout
    "http://[::a9fe:a9fe]": "embeds 169.254.169.254",  # IPv4-compatible
    "http://[2002:a9fe:a9fe::1]": "embeds 169.254.169.254",  # 6to4
    "http://[::ffff:0:a9fe:a9fe]": "embeds 169.254.169.254",  # IPv4-translated
    "http://[::ffff:0:a9fe:1]": "embeds 169.254.0.1 is link-local",
    "http://[2001:0:4136:e378:8000:63bf:5601:5601]": "embeds 169.254.169.254",  # Teredo (client bits inverted)
    "http://metadata.google.internal": "cloud metadata name",
    "http://METADATA.google.internal.:80": "cloud metadata name",
    "http://0.0.0.0:8000": "not a unicast address",
    "ftp://127.0.0.1:8000": "[pP][sS]?:",  # the schema pattern already refuses it
    "http://:8000": "no host",
    "http://127.0.0.1:99999": "not a valid URL",
    "http://exa\u200bmple.com": "control characters",
    "http://exämple.com": "ASCII DNS name",
}


@pytest.mark.parametrize("url", list(ATTACKS))
async def test_attack_urls_are_refused_naming_the_problem(cp: AsyncTestClient, url: str) -> None:
    r = await cp.post(f"{ENGINES}/register", json=spec(url=url), headers=admin())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "url" and ATTACKS[url] in error["message"], error
    assert (await cp.get(ENGINES, headers=reader())).json()["data"] == []


async def test_an_inference_url_passes_the_same_rules_and_a_refusal_names_it(cp: AsyncTestClient,
                                                                            role_settings: ControlPlaneSettings) -> None:
    for url in ("http://127.0.0.1:8000/?x=", "http://127.0.0.1:8000/v1/evil", "http://user:pw@127.0.0.1:8000",
                "http://0x7f.1:8000", "http://169.254.169.254", "http://[64:ff9b::a9fe:a9fe]",
                "http://metadata.google.internal", "http://0.0.0.0:8000", "ftp://127.0.0.1:8000"):
        r = await cp.post(f"{ENGINES}/register", json={**spec(), "kind": "vllm", "inference_url": url}, headers=admin())
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "inference_url" and ATTACKS[url] in error["message"], error
    assert (await cp.get(ENGINES, headers=reader())).json()["data"] == []
    assert ("register_engine", "e1", "400 invalid_request_error") in await audit(role_settings.database_url)
    only = dataclasses.replace(role_settings, engine_allowed_networks=("10.0.0.0/8",))
    async with AsyncTestClient(app=create_app(only)) as c:
        r = await c.post(f"{ENGINES}/register", headers=admin(),
                         json={**spec(url="http://10.1.2.3:80"), "inference_url": "http://127.0.0.1:8000"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "inference_url"
        assert "outside the allowed engine networks" in r.json()["error"]["message"]


async def test_good_urls_are_accepted_and_normalized(cp: AsyncTestClient) -> None:
    for url, stored in (("http://127.0.0.1:8000/", "http://127.0.0.1:8000"), ("HTTPS://[::1]:9", "https://[::1]:9"),
                        ("http://[64:ff9b::a00:5]:80", "http://[64:ff9b::a00:5]:80"),  # NAT64 of 10.0.0.5
                        ("http://localhost:8000", "http://localhost:8000")):
        r = await cp.post(f"{ENGINES}/register", json=spec(url=url), headers=admin())
        assert r.status_code == 200 and r.json()["url"] == stored, r.text


async def test_an_allow_list_of_networks_confines_engine_urls(role_settings: ControlPlaneSettings) -> None:
    only = dataclasses.replace(role_settings, engine_allowed_networks=("10.0.0.0/8",))
    async with AsyncTestClient(app=create_app(only)) as c:
        assert (await c.post(f"{ENGINES}/register", json=spec(url="http://10.1.2.3:80"), headers=admin())).status_code == 200
        r = await c.post(f"{ENGINES}/register", json=spec(url="http://127.0.0.1:80"), headers=admin())
        assert r.status_code == 400 and "outside the allowed engine networks" in r.json()["error"]["message"]
        r = await c.post(f"{ENGINES}/register", json=spec(url="http://localhost:80"), headers=admin())
        assert r.status_code == 400 and "resolves to 127.0.0.1 is outside" in r.json()["error"]["message"]


async def test_an_engine_token_acts_only_for_its_own_engine(cp: AsyncTestClient, role_settings, demo: dict) -> None:
    assert (await cp.post(f"{ENGINES}/register", json=spec("e1"), headers=as_engine())).status_code == 200
    # another engine's name: 403, audited
    r = await cp.post(f"{ENGINES}/register", json=spec("e2"), headers=as_engine())
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert (await cp.post(f"{ENGINES}/register", json=spec("e2"), headers=admin())).status_code == 200  # admin: any
    assert (await cp.post(f"{ENGINES}/e2/heartbeat", json={}, headers=as_engine())).status_code == 403
    assert (await cp.post(f"{ENGINES}/e2/drain", headers=as_engine())).status_code == 403
    assert (await cp.post(f"{ENGINES}/e1/heartbeat", json={}, headers=as_engine())).status_code == 200
    # nothing else: no loads, no listings, no deletes, no reconciles
    for method, path, body in (
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(demo["demo-short"]), "base_model": "demo"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
        ("GET", "/v1/lora_adapters", None), ("GET", ENGINES, None), ("GET", "/v1/lora_stats", None),
        ("DELETE", f"{ENGINES}/e1", None), ("POST", f"{ENGINES}/reconcile", None),
    ):
        r = await cp.request(method, path, json=body, headers=as_engine())
        assert r.status_code == 403, (method, path, r.text)
    # read tokens may not act as an engine either
    assert (await cp.post(f"{ENGINES}/e1/heartbeat", json={}, headers=reader())).status_code == 403
    outcomes = [(a, t, o) for a, t, o in await audit(role_settings.database_url) if o.startswith("403")]
    assert ("register_engine", "e2", "403 permission_error") in outcomes
    assert ("drain_engine", "e2", "403 permission_error") in outcomes
    assert any(a == "load_lora_adapter" for a, _, _ in outcomes)


async def test_unhealthy_or_draining_heartbeats_stop_placements_at_once(cp: AsyncTestClient, demo: dict) -> None:
    for name in ("e1", "e2"):
        assert (await cp.post(f"{ENGINES}/register", json=spec(name), headers=admin())).status_code == 200
    r = await cp.post(f"{ENGINES}/e1/heartbeat", headers=as_engine(),
                      json={"healthy": False, "reason": "step loop died: KeyError\x1b[0m"})
    assert r.status_code == 200 and r.json()["state"] == "unhealthy"
    r = await cp.post(f"{ENGINES}/e2/heartbeat", json={"draining": True}, headers=as_engine(E2_TOKEN))
    assert r.json()["state"] == "draining"
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    assert r.status_code == 200 and r.json()["engines"] == []  # neither engine gets it
    # draining sticks until the engine registers again (a restart); a healthy heartbeat is not enough
    r = await cp.post(f"{ENGINES}/e2/heartbeat", json={}, headers=as_engine(E2_TOKEN))
    assert r.json()["state"] == "draining"
    r = await cp.post(f"{ENGINES}/e1/heartbeat", json={}, headers=as_engine())
    assert r.json()["state"] == "healthy"


async def test_drain_is_audited_and_takes_the_engine_out_of_placement(cp: AsyncTestClient, role_settings,
                                                                      demo: dict) -> None:
    assert (await cp.post(f"{ENGINES}/register", json=spec("e1"), headers=as_engine())).status_code == 200
    r = await cp.post(f"{ENGINES}/e1/drain", headers=as_engine())
    assert r.status_code == 200 and r.json()["state"] == "draining", r.text
    assert (await cp.post(f"{ENGINES}/nope/drain", headers=admin())).status_code == 404
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    assert r.json()["engines"] == []
    assert ("drain_engine", "e1", "ok") in await audit(role_settings.database_url)
    # registering again (the engine restarted) makes it healthy
    r = await cp.post(f"{ENGINES}/register", json=spec("e1"), headers=as_engine())
    assert r.json()["state"] == "healthy"


async def test_resolve_with_an_engine_token_records_its_own_placement_only(cp: AsyncTestClient, demo: dict) -> None:
    assert (await cp.post(f"{ENGINES}/register", json=spec("e1"), headers=as_engine())).status_code == 200
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "org/a", "lora_path": str(demo["demo-short"]), "base_model": "demo", "engines": []})
    assert r.status_code == 200 and r.json()["engines"] == [], r.text
    # quoted `/` is accepted; the engine named is the token's own
    r = await cp.get("/v1/resolve/org%2Fa", params={"base_model": "demo", "engine": "e1"}, headers=as_engine())
    assert r.status_code == 200 and r.json()["name"] == "org/a", r.text
    r = await cp.get("/v1/resolve/org/a", params={"base_model": "demo", "engine": "e2"}, headers=as_engine())
    assert r.status_code == 403
    # names the name rule refuses never reach a lookup (the engine's `model: "../lora_stats"`)
    for bad in ("%2E%2E%2Flora_stats", "a%2F..%2Fb", "a%0A", "a%00", "%2E"):
        r = await cp.get(f"/v1/resolve/{bad}", params={"base_model": "demo"}, headers=as_engine())
        assert r.status_code == 400 and r.json()["error"]["param"] == "name", (bad, r.text)
    placed = (await cp.get("/v1/lora_adapters/org/a", headers=reader())).json()["placements"]
    assert [(p["engine"], p["desired"]) for p in placed] == [("e1", "loaded")]
