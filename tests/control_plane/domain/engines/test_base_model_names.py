"""An engine may not serve a base model named like a registered adapter (the mirror of the adapters'
rule). Engines answer `model` = their base model's name with the base itself, so such an engine
would silently serve the base to requests meant for the adapter, and the adapter never there."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import audit

ENGINES = "/v1/engines"


def spec(name: str, base_model: str) -> dict:
    return {"name": name, "url": "http://127.0.0.1:1", "base_model": base_model, "slots_total": 4}


async def test_registering_a_base_model_named_like_an_adapter_is_refused(
        client: AsyncTestClient, demo: dict, settings) -> None:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": "pirate", "lora_path": str(demo["demo-pirate"]), "base_model": "demo"})
    assert r.status_code == 200, r.text
    r = await client.post(f"{ENGINES}/register", json=spec("e1", "pirate"), headers=admin())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "base_model" and error["type"] == "invalid_request_error"
    assert "'pirate' is the name of a registered adapter" in error["message"]
    assert (await client.get(ENGINES, headers=reader())).json()["data"] == []  # nothing recorded
    assert ("register_engine", "e1", "400 invalid_request_error") in await audit(settings.database_url)
    # the adapter's own base model, and any other name, still register
    for name, base in (("e1", "demo"), ("e2", "pirate-base")):
        r = await client.post(f"{ENGINES}/register", json=spec(name, base), headers=admin())
        assert r.status_code == 200, r.text
