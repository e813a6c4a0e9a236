"""The tenants API on both databases: tenants, keys shown once and kept as HMAC hashes under the pepper,
revocation, the adapters quota, moving adapters, and tenant keys with admin:<tenant> acting on their own
adapters only (another tenant's adapter is a 404, everything outside their tenant a 403). Keys hashed with
argon2 (as keys were made before the pepper) still work and are rewritten as HMAC on their first use, here
or through a router's rehash call; without a pepper no key is made; failed attempts are limited (429)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from argon2 import PasswordHasher
from litestar.testing import AsyncTestClient
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.app import create_app
from control_plane.db.models import ApiKey, AuditEvent
from control_plane.settings import ControlPlaneSettings
from shared.key_secrets import KeyHasher
from shared.tenants import split_key
from tests.control_plane.conftest import KEY_PEPPER, admin, reader
from tests.control_plane.domain.adapters.helpers import fetch_all
from tests.control_plane.domain.tenants.helpers import bearer, make_key, make_tenant


async def test_keys_are_shown_once_hashed_and_never_audited(client: AsyncTestClient, db_url: str) -> None:
    await make_tenant(client, "team-a", requests_per_minute=60, adapters=2)
    assert (await client.post("/v1/tenants", json={"name": "team-a"}, headers=admin())).status_code == 409
    assert (await client.post("/v1/tenants", json={"name": "Bad Name"}, headers=admin())).status_code == 400
    assert (await client.post("/v1/tenants", json={"name": "team-b"}, headers=reader())).status_code == 403
    key = await make_key(client, "team-a", "inference", "admin:team-a")
    key_id, secret = split_key(key)
    # a scope for another tenant is refused
    r = await client.post("/v1/tenants/team-a/keys", json={"name": "x", "scopes": ["admin:team-b"]}, headers=admin())
    assert r.status_code == 400 and r.json()["error"]["param"] == "scopes"

    listed = (await client.get("/v1/tenants/team-a/keys", headers=reader())).json()["data"]
    assert [k["key_id"] for k in listed] == [key_id] and secret not in str(listed)
    tenant = (await client.get("/v1/tenants/team-a", headers=reader())).json()
    assert tenant["limits"]["requests_per_minute"] == 60 and tenant["keys"] == 1

    (row,) = await fetch_all(db_url, ApiKey)
    assert secret not in row.secret_hash and row.secret_hash.startswith("$hmac-sha256$")
    hasher = KeyHasher(KEY_PEPPER)
    assert hasher.verify(key_id, secret, row.secret_hash)
    assert not hasher.verify(key_id, secret[:-1] + ("x" if secret[-1] != "x" else "y"), row.secret_hash)
    assert not KeyHasher("another-pepper-" + "q" * 32).verify(key_id, secret, row.secret_hash)
    audit = " ".join(f"{e.actor} {e.action} {e.target} {e.outcome}" for e in await fetch_all(db_url, AuditEvent))
    assert f"create_api_key team-a/{key_id} ok" in audit and secret not in audit and key not in audit


async def test_a_tenant_key_manages_its_own_adapters_only(client: AsyncTestClient, demo: dict[str, Path],
                                                          db_url: str) -> None:
    await make_tenant(client, "team-a", sources=[str(demo["root"])], adapters=1)
    await make_tenant(client, "team-b")
    a_admin = bearer(await make_key(client, "team-a", "admin:team-a"))
    a_inference = bearer(await make_key(client, "team-a", "inference"))
    b_admin = bearer(await make_key(client, "team-b", "admin:team-b"))

    # team-a's key loads an adapter: team-a owns it, private
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "pirate-a", "lora_path": str(demo["demo-pirate"]),
                                                         "base_model": "demo"}, headers=a_admin)
    assert r.status_code == 200, r.text
    owned = (await client.get("/v1/tenants/team-a/adapters", headers=a_admin)).json()["adapters"]
    assert owned == [{"name": "pirate-a", "owner": "team-a", "public": False}]
    # the adapters quota (1): a second new adapter is refused
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "poet-a", "lora_path": str(demo["demo-poet"]),
                                                         "base_model": "demo"}, headers=a_admin)
    assert r.status_code == 409, r.text
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=a_admin)).status_code == 200

    # team-b's key: team-a's adapter does not exist for it, reading or changing
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=b_admin)).status_code == 404
    r = await client.patch("/v1/lora_adapters/pirate-a", json={"pinned": True}, headers=b_admin)
    assert r.status_code == 404
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "pirate-a"}, headers=b_admin)
    assert r.status_code == 404
    assert (await client.delete("/v1/lora_adapters/pirate-a", headers=b_admin)).status_code == 404
    # nor do other tenants, or anything outside its tenant
    assert (await client.get("/v1/tenants/team-a/keys", headers=b_admin)).status_code == 404
    assert (await client.get("/v1/engines", headers=b_admin)).status_code == 403
    assert (await client.get("/v1/lora_adapters", headers=b_admin)).status_code == 403
    assert (await client.post("/v1/tenants", json={"name": "team-c"}, headers=b_admin)).status_code == 403
    # a key without admin:<tenant> manages nothing
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=a_inference)).status_code == 403

    # public: team-b may read it, still not change it
    r = await client.put("/v1/tenancy/adapters/pirate-a", json={"owner": "team-a", "public": True}, headers=admin())
    assert r.status_code == 200, r.text
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=b_admin)).status_code == 200
    assert (await client.patch("/v1/lora_adapters/pirate-a", json={"pinned": True}, headers=b_admin)).status_code == 404
    # moved to team-b: now team-b's to change, and team-a's no more
    r = await client.put("/v1/tenancy/adapters/pirate-a", json={"owner": "team-b", "public": False}, headers=admin())
    assert r.status_code == 200, r.text
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=a_admin)).status_code == 404
    assert (await client.get("/v1/lora_adapters/pirate-a", headers=b_admin)).status_code == 200
    access = (await client.get("/v1/tenancy/adapters", headers=reader())).json()["adapters"]
    assert access == [{"name": "pirate-a", "owner": "team-b", "public": False}]
    actions = {(e.action, e.outcome) for e in await fetch_all(db_url, AuditEvent)}
    assert ("set_adapter_access", "ok") in actions and ("load_lora_adapter", "409 conflict_error") in actions


async def test_a_revoked_key_stops_at_once_and_its_record_says_so(client: AsyncTestClient) -> None:
    await make_tenant(client, "team-a")
    key = await make_key(client, "team-a", "admin:team-a")
    key_id, secret = split_key(key)
    assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 200
    wrong = f"lp_{key_id}_{'x' * len(secret)}"
    assert (await client.get("/v1/tenants/team-a", headers=bearer(wrong))).status_code == 401  # cached: still compared
    r = await client.delete(f"/v1/tenants/team-a/keys/{key_id}", headers=bearer(key))  # it may revoke itself
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 401
    # routers read the record with their token (read tokens may not: it holds the hash)
    assert (await client.get(f"/v1/tenancy/keys/{key_id}", headers=reader())).status_code == 403
    record = (await client.get(f"/v1/tenancy/keys/{key_id}", headers=admin())).json()
    assert record["revoked"] is True and record["tenant"] == "team-a" and secret not in str(record)
    assert (await client.get("/v1/tenancy/keys/000000000000", headers=admin())).status_code == 404


async def test_quotas_are_set_and_published_in_the_key_record(client: AsyncTestClient, db_url: str) -> None:
    await make_tenant(client, "team-a", requests_per_minute=10)
    key_id, _ = split_key(await make_key(client, "team-a"))
    r = await client.patch("/v1/tenants/team-a", json={"limits": {"tokens_per_minute": 500, "concurrent_requests": 2}},
                           headers=admin())
    assert r.status_code == 200, r.text
    record = (await client.get(f"/v1/tenancy/keys/{key_id}", headers=admin())).json()
    assert record["tenant_limits"] == {"requests_per_minute": None, "tokens_per_minute": 500,
                                       "concurrent_requests": 2, "adapters": None}
    engine = create_async_engine(db_url)
    try:
        async with async_sessionmaker(engine)() as session:
            used = await session.scalar(select(ApiKey.last_used_at))
    finally:
        await engine.dispose()
    assert used is not None  # the router's check counts as a use


async def set_hash(db_url: str, key_id: str, secret_hash: str) -> None:
    engine = create_async_engine(db_url)
    try:
        async with async_sessionmaker(engine)() as session, session.begin():
            await session.execute(update(ApiKey).where(ApiKey.key_id == key_id).values(secret_hash=secret_hash))
    finally:
        await engine.dispose()


async def stored_hash(db_url: str, key_id: str) -> str:
    return next(row.secret_hash for row in await fetch_all(db_url, ApiKey) if row.key_id == key_id)


async def legacy_key(client: AsyncTestClient, db_url: str, tenant: str, *scopes: str) -> str:
    """A key whose stored hash is argon2 of its secret, as keys were made before the pepper."""
    key = await make_key(client, tenant, *scopes)
    key_id, secret = split_key(key)
    await set_hash(db_url, key_id, PasswordHasher().hash(secret))
    return key


async def test_a_legacy_key_works_and_is_rewritten_as_hmac_on_first_use(client: AsyncTestClient, db_url: str) -> None:
    await make_tenant(client, "team-a")
    key = await legacy_key(client, db_url, "team-a", "admin:team-a")
    key_id, secret = split_key(key)
    assert (await stored_hash(db_url, key_id)).startswith("$argon2id$")
    assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 200
    rewritten = await stored_hash(db_url, key_id)
    assert KeyHasher(KEY_PEPPER).verify(key_id, secret, rewritten)
    # a wrong secret is refused and rewrites nothing
    other = await legacy_key(client, db_url, "team-a", "admin:team-a")
    other_id, other_secret = split_key(other)
    before = await stored_hash(db_url, other_id)
    wrong = f"lp_{other_id}_{'x' * len(other_secret)}"
    assert (await client.get("/v1/tenants/team-a", headers=bearer(wrong))).status_code == 401
    assert await stored_hash(db_url, other_id) == before


async def test_a_router_has_a_legacy_hash_rewritten(settings: ControlPlaneSettings, db_url: str) -> None:
    router = "router-token-of-the-rehash-test"
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, router_tokens=(router,)))) as client:
        await make_tenant(client, "team-a")
        key = await legacy_key(client, db_url, "team-a")
        key_id, secret = split_key(key)
        path = f"/v1/tenancy/keys/{key_id}/rehash"
        for body, status, param in (({"key": f"lp_{key_id}_{'x' * 43}"}, 400, "key"),  # not its secret
                                    ({"key": f"lp_{'0' * 12}_{secret}"}, 400, "key"),  # another key id's
                                    ({"key": "not-a-key"}, 400, "key")):
            r = await client.post(path, json=body, headers=bearer(router))
            assert r.status_code == status and r.json()["error"]["param"] == param, r.text
            assert secret not in r.text
        assert (await stored_hash(db_url, key_id)).startswith("$argon2id$")
        unknown = await client.post(f"/v1/tenancy/keys/{'0' * 12}/rehash", json={"key": f"lp_{'0' * 12}_{secret}"},
                                    headers=bearer(router))
        assert unknown.status_code == 404
        assert (await client.post(path, json={"key": key}, headers=reader())).status_code == 403
        for _ in range(2):  # the second finds it rewritten already: the same answer
            r = await client.post(path, json={"key": key}, headers=bearer(router))
            assert r.status_code == 200, r.text
            record = r.json()
            assert record["key_id"] == key_id and record["secret_hash"].startswith("$hmac-sha256$")
            assert secret not in r.text and KEY_PEPPER not in r.text
        assert await stored_hash(db_url, key_id) == record["secret_hash"]
        assert KeyHasher(KEY_PEPPER).verify(key_id, secret, record["secret_hash"])


async def test_without_a_pepper_no_key_is_made_and_legacy_keys_still_work(settings: ControlPlaneSettings,
                                                                          db_url: str) -> None:
    async with AsyncTestClient(app=create_app(settings)) as client:
        await make_tenant(client, "team-a")
        key = await legacy_key(client, db_url, "team-a", "admin:team-a")
        made = await make_key(client, "team-a", "admin:team-a")
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, key_pepper=None))) as client:
        r = await client.post("/v1/tenants/team-a/keys", json={"name": "k"}, headers=admin())
        assert r.status_code == 503 and "LORAPLANE_KEY_PEPPER" in r.json()["error"]["message"], r.text
        assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 200
        assert (await stored_hash(db_url, split_key(key)[0])).startswith("$argon2id$")  # nothing to rewrite it with
        r = await client.get("/v1/tenants/team-a", headers=bearer(made))
        assert r.status_code == 503 and "LORAPLANE_KEY_PEPPER" in r.json()["error"]["message"], r.text


async def test_failed_attempts_are_refused_past_the_limit_without_a_lookup(settings: ControlPlaneSettings) -> None:
    limited = dataclasses.replace(settings, key_failures_per_address=3, key_failures_per_key=100)
    async with AsyncTestClient(app=create_app(limited)) as client:
        await make_tenant(client, "team-a")
        key = await make_key(client, "team-a", "admin:team-a")
        key_id, secret = split_key(key)
        assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 200  # verified: cached
        statuses = []
        for i in range(5):
            wrong = f"lp_{(str(i) * 12)}_{'x' * 43}"  # unknown key ids: each a lookup until the limit
            statuses.append((await client.get("/v1/tenants/team-a", headers=bearer(wrong))).status_code)
        assert statuses == [401, 401, 401, 429, 429]
        r = await client.get("/v1/tenants/team-a", headers=bearer(f"lp_{key_id}_{'y' * 43}"))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
        # the key's own secret, verified already, is never refused
        assert (await client.get("/v1/tenants/team-a", headers=bearer(key))).status_code == 200
