"""Who owns which adapter, and re-targeting an adapter to another base model, over real processes: `loraplane
control` (SQLite), engine e1 serving the demo checkpoint as `demo` and e2 serving the same checkpoint as
`demo-b`, and the admin CLI run as an operator runs it.

Ownership: the admin JSON (list and detail) carries `owner` and `public`, the list filters by owner (a
tenant, `-` for nobody's) and visibility; `loraplane adapters list|show` and `loraplane tenants show`
print them (keys by id, never a secret).

Re-target: an adapter loaded under a wrong base model is served by no engine (404 through the engine) and
a load naming the right one is a 409 that names the command; read tokens and tenant keys may not
re-target (403); `loraplane adapters update NAME --base-model demo` places it on e1 (served there,
audited with the old and new base); re-targeted to `demo-b`, e1 unloads it (its placement removed) and
e2 serves it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.control_plane.admin_cli.test_cli import Fleet, as_json, cli, ok
from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    complete,
    control_plane,
    engine_auth,
    engine_token,
    wait_for,
)

openai = pytest.importorskip("openai")




@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, dict[str, str]]]:
    """The control plane with e1 (`demo`) and e2 (`demo-b`, the same checkpoint) registered; the Fleet
    names e1, and the map gives each engine's OpenAI base URL."""
    tmp = tmp_path_factory.mktemp("ownership")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    adapters = write_demo_adapters(base, root)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(control_plane(tmp, root))
        flags = ("--enable-lora", "--lora-roots", str(root), "--control-plane", url, *SHARED_FLAGS)
        e1 = stack.enter_context(run_engine(base, tmp / "e1.log", *flags, "--engine-name", "e1",
                                            "--admin-token", engine_token("e1"),
                                            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"]}))
        e2 = stack.enter_context(run_engine(base, tmp / "e2.log", *flags, "--engine-name", "e2",
                                            "--admin-token", engine_token("e2"),
                                            "--served-model-name", "demo-b",
                                            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e2"]}))
        wait_for(lambda: sorted(e["name"] for e in httpx.get(f"{url}/v1/engines", timeout=5, headers={
            "Authorization": f"Bearer {READ}"}).json()["data"]) == ["e1", "e2"], "e1 and e2 to register")
        yield Fleet(url, e1, adapters, tmp), {"e1": e1.api, "e2": e2.api}


def _admin(fleet: Fleet) -> httpx.Client:
    return httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)


def _tenant_key(admin: httpx.Client, tenant: str) -> str:
    """A new key of `tenant` (created with the tenant when missing) that may manage its adapters."""
    admin.post("/v1/tenants", json={"name": tenant, "limits": {"adapters": 5}, "sources": []})
    r = admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "ops", "scopes": [f"admin:{tenant}"]})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def test_owner_and_visibility_in_the_api_the_cli_and_tenants_show(fleet: tuple[Fleet, dict[str, str]]) -> None:
    cp, _ = fleet
    admin = _admin(cp)
    for name in ("own/private", "own/public", "own/nobody"):
        r = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(cp.adapters["demo-pirate"]),
                                                      "base_model": "demo", "replicas": {"min": 0}})
        assert r.status_code == 200, r.text
    key = _tenant_key(admin, "team-own")
    for name, public in (("own/private", False), ("own/public", True)):
        r = admin.put(f"/v1/tenancy/adapters/{name}", json={"owner": "team-own", "public": public})
        assert r.status_code == 200, r.text

    def listed(**params: str) -> dict[str, tuple[str | None, bool]]:
        r = admin.get("/v1/lora_adapters", params={"name_prefix": "own/", **params})
        assert r.status_code == 200, r.text
        return {a["name"]: (a["owner"], a["public"]) for a in r.json()["data"]}

    assert listed() == {"own/nobody": (None, False), "own/private": ("team-own", False),
                        "own/public": ("team-own", True)}
    assert set(listed(owner="team-own")) == {"own/private", "own/public"}
    assert set(listed(owner="-")) == {"own/nobody"}
    assert set(listed(owner="team-own", visibility="public")) == {"own/public"}
    assert set(listed(visibility="private")) == {"own/nobody", "own/private"}
    assert listed(owner="no-such-tenant") == {}
    r = admin.get("/v1/lora_adapters", params={"owner": "Not A Tenant"})
    assert r.status_code == 400 and "owner" in r.text, r.text
    detail = admin.get("/v1/lora_adapters/own/private").json()
    assert (detail["owner"], detail["public"]) == ("team-own", False)
    # a tenant key reads its own adapter with its owner
    mine = httpx.get(f"{cp.url}/v1/lora_adapters/own/public", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert mine.status_code == 200 and mine.json()["owner"] == "team-own", mine.text

    table = ok(cli(cp, "adapters", "list", "--prefix", "own/")).stdout
    assert "OWNER" in table.splitlines()[0], table
    rows = {line.split()[0]: line for line in table.splitlines()[1:] if line.startswith("own/")}
    assert "team-own (private)" in rows["own/private"] and "team-own (public)" in rows["own/public"], table
    assert "team-own" not in rows["own/nobody"], table
    only = ok(cli(cp, "adapters", "list", "--owner", "-", "--prefix", "own/")).stdout
    assert "own/nobody" in only and "own/private" not in only, only
    shown = ok(cli(cp, "adapters", "show", "own/public")).stdout
    assert any(line.split()[:3] == ["owner", "team-own", "(public)"] for line in shown.splitlines()), shown

    shown = ok(cli(cp, "tenants", "show", "team-own")).stdout
    key_id = key.split("_")[1]
    assert key_id in shown and key not in shown and key.split("_", 2)[2] not in shown, shown
    assert "adapters 5" in shown, shown  # its limits
    assert any(line.split() == ["own/private", "private"] for line in shown.splitlines()), shown
    assert any(line.split() == ["own/public", "public"] for line in shown.splitlines()), shown
    assert "own/nobody" not in shown, shown
    as_tenant = as_json(cli(cp, "tenants", "show", "team-own", "--json", token=key))  # its own tenant
    assert [a["name"] for a in as_tenant["owned_adapters"]] == ["own/private", "own/public"]
    assert [k["key_id"] for k in as_tenant["api_keys"]] == [key_id]
    missing = cli(cp, "tenants", "show", "no-such-tenant")
    assert missing.returncode == 2 and "no tenant named" in missing.stderr, missing.stderr


def test_retarget_moves_an_adapter_to_the_engines_of_its_new_base_model(
        fleet: tuple[Fleet, dict[str, str]]) -> None:
    cp, api = fleet
    admin = _admin(cp)
    base_text = complete(api["e1"], "demo")
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": str(cp.adapters["demo-pirate"]),
                                                  "base_model": "models/demo-typo"})
    assert r.status_code == 200 and r.json()["engines"] == [] and "no engine serves" in r.json()["warning"], r.text
    with pytest.raises((openai.NotFoundError, openai.InternalServerError)):  # no engine serves its base model
        complete(api["e1"], "wrong")

    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": str(cp.adapters["demo-pirate"]),
                                                  "base_model": "demo"})
    assert r.status_code == 409, r.text
    assert "loraplane adapters update wrong --base-model demo" in r.json()["error"]["message"], r.text

    # refused: a read token, a tenant key of its owner, nonsense
    key = _tenant_key(admin, "team-rt")
    assert admin.put("/v1/tenancy/adapters/wrong", json={"owner": "team-rt", "public": False}).status_code == 200
    for token in (READ, key):
        r = httpx.patch(f"{cp.url}/v1/lora_adapters/wrong", json={"base_model": "demo"},
                        headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 403, r.text
    for body, names in (({"base_model": ""}, "base_model"), ({"base_model": "demo", "colour": "red"}, "colour"),
                        ({}, "base_model")):
        r = admin.patch("/v1/lora_adapters/wrong", json=body)
        assert r.status_code == 400 and names in r.json()["error"]["message"], (body, r.text)
    r = admin.patch("/v1/lora_adapters/wrong", json={"base_model": "wrong"})  # named like its base model
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert admin.get("/v1/lora_adapters/wrong").json()["base_model"] == "models/demo-typo"

    moved = as_json(cli(cp, "adapters", "update", "wrong", "--base-model", "demo", "--json"))
    assert moved["base_model"] == "demo" and [(e["engine"], e["outcome"]) for e in moved["engines"]] == [
        ("e1", "loaded")], moved
    served = complete(api["e1"], "wrong")
    assert served != base_text
    trail = admin.get("/v1/audit", params={"action": "retarget_lora_adapter"}).json()["data"]
    outcomes = sorted((e["actor"].split(":")[0], e["outcome"]) for e in trail)
    assert outcomes == [("admin", "400 invalid_request_error"), ("admin", "ok"), ("tenant", "403 permission_error")], trail
    assert next(e["detail"] for e in trail if e["outcome"] == "ok") == {"from": "models/demo-typo", "to": "demo"}

    text = ok(cli(cp, "adapters", "update", "wrong", "--base-model", "demo-b")).stdout
    assert "e1" in text and "unloaded" in text and "e2" in text and "loaded" in text, text
    detail = admin.get("/v1/lora_adapters/wrong").json()
    assert [(p["engine"], p["desired"], p["observed"]) for p in detail["placements"]] == [
        ("e2", "loaded", "loaded")], detail
    assert complete(api["e2"], "wrong") == served  # the same checkpoint and adapter: the same text
    with pytest.raises(openai.NotFoundError):
        complete(api["e1"], "wrong")
    listed = httpx.get(api["e1"] + "/lora_adapters", headers=engine_auth("e1"),
                       timeout=10).json()["adapters"]
    assert "wrong" not in [a["name"] for a in listed]
