"""Guessing tenant keys' secrets, against real processes: `loraplane control` (SQLite, the real Redis at
127.0.0.1:6379, a key pepper) and `loraplane router --require-api-key` processes, no engine (GET /v1/models
is the authenticated call).

The cost of wrong secrets is the router process's own CPU time (/proc/<pid>/stat), against the same number
of requests with a good key: a slow hash per guess (argon2: a fifth of a CPU-second each) cost tens of
CPU-seconds for 200 guesses. Past the failures allowed per address and per key id the answer is a 429 in
OpenAI's shape with Retry-After, and no hash is computed (an argon2 key's CPU says so); the key's holder
keeps working from other addresses (127.0.0.x: Linux routes all of 127/8 to loopback). A key stored with
an argon2 hash, as keys were made before the pepper, still works and is stored as HMAC after its first
use, through a router and through the control plane. The pepper is in no log and no answer.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from argon2 import PasswordHasher

from tests.data_plane.router.support import wait_until
from tests.e2e.test_control_plane_engines import ADMIN, KEY_PEPPER, control_plane
from tests.e2e.test_tenants import REDIS_URL, ROUTER_TOKEN, redis_ok, router_process

GUESSES = 200
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass
class Plane:
    cp: str
    prefix: str
    database: Path
    tmp: Path
    admin: httpx.Client
    logs: list[Path]
    answers: list[str] = field(default_factory=list)  # every answer's body the tests saw, to look for the pepper

    def make_key(self, tenant: str, *scopes: str) -> str:
        r = self.admin.post(f"{self.cp}/v1/tenants/{tenant}/keys", json={"name": "k", "scopes": list(scopes)})
        assert r.status_code == 201, r.text
        self.answers.append(r.text)
        return r.json()["key"]

    def stored_hash(self, key_id: str) -> str:
        with contextlib.closing(sqlite3.connect(self.database)) as db:
            return db.execute("SELECT secret_hash FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()[0]

    def make_legacy(self, key: str) -> None:
        """Store the key's hash as the control plane did before the pepper: argon2id of its secret."""
        key_id, secret = key.split("_", 2)[1:]
        with contextlib.closing(sqlite3.connect(self.database)) as db, db:
            db.execute("UPDATE api_keys SET secret_hash = ? WHERE key_id = ?", (PasswordHasher().hash(secret), key_id))

    @contextlib.contextmanager
    def router(self, name: str, *flags: str, pepper: bool = True) -> Iterator[tuple[str, int]]:
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        with router_process(self.cp, self.prefix, log, *flags, pepper=pepper) as (url, process):
            yield url, process.pid


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    if not redis_ok():
        pytest.skip("no Redis at 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("guessing")
    prefix = f"lptest:{uuid.uuid4().hex[:8]}:"
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as admin, \
            control_plane(tmp, tmp, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN, LORAPLANE_REDIS_URL=REDIS_URL,
                          LORAPLANE_REDIS_PREFIX=prefix, LORAPLANE_LOG_LEVEL="info") as cp:
        r = admin.post(cp + "/v1/tenants", json={"name": "team-g"})
        assert r.status_code == 201, r.text
        yield Plane(cp, prefix, tmp / "control.db", tmp, admin, [tmp / "control.log"])
    client = redis.Redis.from_url(REDIS_URL)
    if leftover := list(client.scan_iter(prefix + "*")):
        client.delete(*leftover)


def cpu_s(pid: int) -> float:
    """The process's user + system CPU time, all its threads (argon2's included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def wrong(key: str) -> str:
    """The key's id with a random secret of the same shape: a guess."""
    return f"lp_{key.split('_')[1]}_{secrets.token_urlsafe(32)}"


def models(client: httpx.Client, url: str, key: str) -> httpx.Response:
    return client.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})


def from_address(last: int) -> httpx.Client:
    """A client whose connections come from 127.0.0.<last>."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=f"127.0.0.{last}"), timeout=60)


def spend(url: str, pid: int, offers: list[str], plane: Plane) -> tuple[float, list[int]]:
    """The router's CPU-seconds for these requests, one after the other, and their statuses."""
    with httpx.Client(timeout=60) as client:
        before = cpu_s(pid)
        answers = [models(client, url, offer) for offer in offers]
        spent = cpu_s(pid) - before
    plane.answers += [a.text for a in answers[:3] + answers[-3:]]
    return spent, [a.status_code for a in answers]


@pytest.mark.parametrize("limits", [(), ("--key-failures-per-address", "1000", "--key-failures-per-key", "1000")],
                         ids=["default-limits", "no-limit-reached"])
def test_wrong_secrets_cost_the_router_no_slow_hash(plane: Plane, limits: tuple[str, ...]) -> None:
    """With the limits out of the way too: the HMAC check itself is as cheap as a cached key."""
    used, attacked = plane.make_key("team-g", "inference"), plane.make_key("team-g", "inference")
    with plane.router(f"router-cpu-{len(limits)}", *limits) as (url, pid):
        good_s, statuses = spend(url, pid, [used] * GUESSES, plane)
        assert statuses == [200] * GUESSES
        # the attacked key was never used on this router: nothing cached of it
        guess_s, statuses = spend(url, pid, [wrong(attacked) for _ in range(GUESSES)], plane)
    assert guess_s < 3 * good_s + 1.0, f"{GUESSES} wrong secrets: {guess_s:.2f} CPU-s, good key: {good_s:.2f} CPU-s"
    assert statuses == ([401] * GUESSES if limits else [401] * 20 + [429] * (GUESSES - 20))


def test_failures_past_the_limit_are_429_without_a_hash(plane: Plane) -> None:
    """On an argon2 key, whose every check costs a fifth of a CPU-second: at most the allowed failures
    (and the few checks under way at once) are hashed; the rest are refused before."""
    used, attacked = plane.make_key("team-g", "inference"), plane.make_key("team-g", "inference")
    plane.make_legacy(attacked)
    hasher, secret = PasswordHasher(), attacked.split("_", 2)[2]
    stored = hasher.hash(secret)
    start = time.process_time()
    for _ in range(3):
        with contextlib.suppress(Exception):
            hasher.verify(stored, "x" + secret[1:])
    one_hash_s = (time.process_time() - start) / 3
    with plane.router("router-limit") as (url, pid):
        good_s, _ = spend(url, pid, [used] * GUESSES, plane)
        guess_s, statuses = spend(url, pid, [wrong(attacked) for _ in range(GUESSES)], plane)
        assert statuses == [401] * 20 + [429] * (GUESSES - 20)  # the router's default: 20 per address
        with httpx.Client() as client:
            refused = models(client, url, wrong(attacked))
        error = refused.json()["error"]
        assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and "address" in error["message"]
        # from another address, the key's holder gets in (and the hash is rewritten: see below)
        with from_address(2) as other:
            assert models(other, url, attacked).status_code == 200
    assert guess_s < 3 * good_s + 1.0 + 25 * one_hash_s, \
        f"{guess_s:.2f} CPU-s for {GUESSES} guesses, one argon2 check {one_hash_s:.2f} CPU-s"


def test_a_key_id_hammered_from_many_addresses_still_serves_its_holder(plane: Plane) -> None:
    key, neighbour = plane.make_key("team-g", "inference"), plane.make_key("team-g", "inference")
    with plane.router("router-per-key", "--key-failures-per-address", "3", "--key-failures-per-key", "6") as (url, _):
        with from_address(2) as holder:
            assert models(holder, url, key).status_code == 200
        for last in (3, 4):  # two attackers, each up to its address's limit: 6 failures of the key id
            with from_address(last) as attacker:
                assert [models(attacker, url, wrong(key)).status_code for _ in range(4)] == [401, 401, 401, 429]
        with from_address(5) as fresh:  # an address with no failures: the key id's limit refuses it
            refused = models(fresh, url, wrong(key))
            assert refused.status_code == 429 and "key id" in refused.json()["error"]["message"]
            assert "retry-after" in refused.headers
            assert models(fresh, url, neighbour).status_code == 200  # other key ids are not affected
        for last in (3, 5, 6):  # the holder, even from an attacker's address, is never refused
            with from_address(last) as client:
                assert models(client, url, key).status_code == 200


def test_an_argon2_key_works_and_is_stored_as_hmac_after_its_first_use(plane: Plane) -> None:
    inference, admin = plane.make_key("team-g", "inference"), plane.make_key("team-g", "admin:team-g")
    for key in (inference, admin):
        plane.make_legacy(key)
        assert plane.stored_hash(key.split("_")[1]).startswith("$argon2id$")
    # through a router: it verifies the argon2 hash and has the control plane rewrite it
    with plane.router("router-legacy") as (url, _), httpx.Client(timeout=60) as client:
        assert models(client, url, inference).status_code == 200
        key_id = inference.split("_")[1]
        wait_until(lambda: plane.stored_hash(key_id).startswith("$hmac-sha256$"), "the router's rehash")
    with plane.router("router-after") as (url, _), httpx.Client(timeout=60) as client:
        assert models(client, url, inference).status_code == 200  # a router that never saw the argon2 hash
        assert models(client, url, wrong(inference)).status_code == 401
    # through the control plane (a tenant admin key)
    r = httpx.get(f"{plane.cp}/v1/tenants/team-g", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert r.status_code == 200, r.text
    plane.answers.append(r.text)
    key_id = admin.split("_")[1]
    wait_until(lambda: plane.stored_hash(key_id).startswith("$hmac-sha256$"), "the control plane's rehash")
    r = httpx.get(f"{plane.cp}/v1/tenants/team-g/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) >= 2
    plane.answers.append(r.text)


def test_a_router_without_the_pepper_verifies_argon2_keys_only(plane: Plane) -> None:
    """The upgrade path of a fleet whose routers have no pepper yet: keys made before it keep working
    (and keep their argon2 hash: this router could not verify the HMAC it would become); keys made since
    are a 503 that names the missing variable, never a 401 that blames the client."""
    legacy, new = plane.make_key("team-g", "inference"), plane.make_key("team-g", "inference")
    plane.make_legacy(legacy)
    with plane.router("router-no-pepper", pepper=False) as (url, _), httpx.Client(timeout=60) as client:
        assert models(client, url, legacy).status_code == 200
        r = models(client, url, new)
        assert r.status_code == 503 and "LORAPLANE_KEY_PEPPER" in r.json()["error"]["message"], r.text
        assert models(client, url, wrong(legacy)).status_code == 401
    # the router has stopped, having finished what it had under way (a rehash it asked for included)
    assert plane.stored_hash(legacy.split("_")[1]).startswith("$argon2id$")


def test_the_pepper_is_in_no_log_and_no_answer(plane: Plane) -> None:
    """Runs last in this module: it reads the logs and answers the others left."""
    key = plane.make_key("team-g", "inference")
    with plane.router("router-pepper") as (url, pid), httpx.Client(timeout=60) as client:
        assert models(client, url, key).status_code == 200
        plane.answers += [client.get(url + path).text for path in ("/health", "/metrics", "/schema/openapi.json")]
        assert KEY_PEPPER not in Path(f"/proc/{pid}/cmdline").read_text()
    record = plane.admin.get(f"{plane.cp}/v1/tenancy/keys/{key.split('_')[1]}")
    assert record.status_code == 200
    plane.answers += [record.text, plane.admin.get(plane.cp + "/v1/audit", params={"limit": 500}).text,
                      plane.admin.get(plane.cp + "/metrics").text]
    logs = "".join(path.read_text() for path in plane.logs if path.exists())
    assert "failed attempts of address 127.0.0.1" in logs and len(plane.answers) > 20  # the others' traces are here
    for where, text in (("logs", logs), *(("an answer", a) for a in plane.answers)):
        assert KEY_PEPPER not in text, where
