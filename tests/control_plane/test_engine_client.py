"""EngineClient: retries, and every call bounded (deadline, body cap, typed replies, no redirects, no echo).

The retry policy is checked with httpx's in-process MockTransport (it scripts a 5xx, which a healthy real
engine does not give on demand). Misbehaviour is checked against real misbehaving servers on loopback
(tests/control_plane/domain/engines/peers.py); calls to real engines are in domain/adapters/test_push.py,
domain/stats/test_bad_engines.py and e2e.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from control_plane.engine_client import EngineAt, EngineCallError, EngineClient, safe_url, sanitize
from control_plane.engine_tokens import engine_admin_token
from tests.control_plane.domain.engines.peers import Reply, always, json_reply, serve

LOADED = {"name": "a", "id": 1, "version": 1, "sha256": "ab" * 32, "rank": 8, "alpha": 16.0,
          "target_modules": ["q_proj"], "size_bytes": 1024}


def at(url: str, name: str = "e1") -> EngineAt:
    return EngineAt(name, url)


def scripted(*answers: int | type[Exception]) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, type):
            raise answer("scripted", request=request)
        return httpx.Response(answer, json={"error": {"message": f"status {answer}"}} if answer >= 400 else LOADED)

    return httpx.MockTransport(handle), seen


async def test_5xx_and_connect_errors_are_retried_then_succeed() -> None:
    transport, seen = scripted(httpx.ConnectError, 503, 200)
    client = EngineClient("tok", 5, backoff_s=0.001, transport=transport)
    loaded = await client.load(at("http://e:1"), "a", "/p", pinned=False, load_inplace=True)
    assert len(seen) == 3 and seen[0].headers["authorization"] == f"Bearer {engine_admin_token('tok', 'e1')}"
    assert loaded.sha256 == "ab" * 32


async def test_each_engine_gets_its_own_token_never_the_secret() -> None:
    transport, seen = scripted(200)
    client = EngineClient("the-secret", 5, transport=transport)
    for name in ("e1", "e2", "e1"):
        await client.unload(at("http://e:1", name), "a")
    sent = [r.headers["authorization"].removeprefix("Bearer ") for r in seen]
    assert sent[0] == sent[2] != sent[1] and "the-secret" not in " ".join(sent)
    assert sent[:2] == [engine_admin_token("the-secret", "e1"), engine_admin_token("the-secret", "e2")]


async def test_4xx_is_not_retried_and_the_message_names_status_not_token() -> None:
    transport, seen = scripted(409)
    client = EngineClient("s3cret", 5, backoff_s=0.001, transport=transport)
    with pytest.raises(EngineCallError) as info:
        await client.load(at("http://e:1"), "a", "/p", pinned=False, load_inplace=True)
    assert len(seen) == 1 and info.value.status == 409 and "status 409" in info.value.message
    assert "s3cret" not in info.value.message


async def test_attempts_are_bounded() -> None:
    transport, seen = scripted(500)
    client = EngineClient(None, 5, max_attempts=3, backoff_s=0.001, transport=transport)
    with pytest.raises(EngineCallError, match="500"):
        await client.stats(at("http://e:1"))
    assert len(seen) == 3 and "authorization" not in seen[0].headers


async def test_unloading_what_an_engine_does_not_hold_is_done() -> None:
    transport, seen = scripted(404)
    assert await EngineClient(None, 5, transport=transport).unload(at("http://e:1"), "a") is None
    assert len(seen) == 1


async def test_a_dripping_engine_fails_at_the_total_deadline() -> None:
    """A byte every 0.3 s never trips a per-read timeout of 1 s; the total deadline still ends the call."""
    with serve(always(Reply(body=b'{"adapters": []' + b" " * 100 + b"}", drip_s=0.3))) as peer:
        client = EngineClient(None, 1.0, backoff_s=0.001)
        start = time.monotonic()
        with pytest.raises(EngineCallError, match="no complete answer within 1 s"):
            await client.list_adapters(at(peer.url))
        assert time.monotonic() - start < 2.0
        await client.aclose()


async def test_a_body_past_the_cap_fails_without_reading_it_all() -> None:
    with serve(always(Reply(body=b"x" * 65536, endless=True))) as endless, \
            serve(always(Reply(body=b"[" + b"1," * 5000 + b"1]"))) as announced:
        client = EngineClient(None, 5.0, max_body_bytes=4096)
        start = time.monotonic()
        for peer in (endless, announced):
            with pytest.raises(EngineCallError, match="reply larger than 4096 bytes"):
                await client.metrics(at(peer.url))
        assert time.monotonic() - start < 2.0
        await client.aclose()


@pytest.mark.parametrize("body", [[1, 2, 3], {"adapters": "x"}, {"adapters": [{"name": 1}]}, "garbage"])
async def test_replies_of_the_wrong_shape_are_a_failed_call(body: object) -> None:
    def reply(_method: str, _path: str) -> Reply:
        return Reply(body=b"\x00garbage{") if body == "garbage" else json_reply(body)

    with serve(reply) as peer:
        client = EngineClient(None, 5.0)
        for call in (client.list_adapters(at(peer.url)), client.stats(at(peer.url)), client.unload(at(peer.url), "a"),
                     client.load(at(peer.url), "a", "/p", pinned=False, load_inplace=False)):
            with pytest.raises(EngineCallError, match="not a valid reply"):
                await call
        await client.aclose()


async def test_redirects_are_failures_and_are_not_followed() -> None:
    with serve(always(json_reply({"adapters": []}))) as elsewhere:
        location = {"location": elsewhere.url + "/v1/lora_adapters"}
        with serve(always(Reply(302, b"", location))) as redirecting:
            client = EngineClient("engine-admin-token", 5.0)
            with pytest.raises(EngineCallError, match="302 Found .redirects are not followed") as info:
                await client.list_adapters(at(redirecting.url))
            assert info.value.status == 302 and len(redirecting.seen) == 1  # final: not retried
            await client.aclose()
        assert elsewhere.seen == []  # the token never went where the redirect pointed


async def test_error_bodies_are_never_echoed_only_a_short_sanitized_reason() -> None:
    internal = b"<html>internal admin page: db password hunter2</html>"
    shouting = {"error": {"message": "bad\x1b[31m\r\nthing " + "y" * 5000}}

    def reply(_method: str, path: str) -> Reply:
        return Reply(403, internal, {"content-type": "text/html"}) if "stats" in path else json_reply(shouting, 400)

    with serve(reply) as peer:
        client = EngineClient(None, 5.0)
        with pytest.raises(EngineCallError) as html:
            await client.stats(at(peer.url))
        assert html.value.message.endswith(": 403 Forbidden") and "hunter2" not in html.value.message
        with pytest.raises(EngineCallError) as long:
            await client.list_adapters(at(peer.url))
        reason = long.value.message.split(": ", 1)[1]
        assert reason.startswith("400 bad [31m thing yyy") and len(reason) <= 210
        assert all(c.isprintable() for c in long.value.message)
        await client.aclose()


def test_urls_in_messages_carry_no_userinfo() -> None:
    assert safe_url("http://user:pw@10.0.0.1:8000/") == "http://10.0.0.1:8000/"
    assert safe_url("https://u@[::1]:9/x?q=1#f") == "https://[::1]:9/x"
    assert sanitize("a\x00b\nc" + "z" * 300, 10) == "a b czzzz…"


async def test_connections_are_checked_against_the_address_policy_before_anything_is_sent() -> None:
    """Registration checks a URL once; a name may resolve elsewhere later (DNS rebinding) and old rows
    predate the check, so every connection is checked again and a refused one sends nothing."""
    with serve(always(json_reply({"adapters": []}))) as peer:
        port = peer.url.rsplit(":", 1)[1]
        confined = EngineClient("engine-admin-token", 5.0, allowed_networks=("10.0.0.0/8",), backoff_s=0.001)
        for url, why in ((peer.url, "127.0.0.1 is outside the allowed engine networks"),
                         (f"http://localhost:{port}", "localhost resolves to 127.0.0.1 is outside")):
            with pytest.raises(EngineCallError, match=f"egress refused: {why}"):
                await confined.list_adapters(at(url))
        assert peer.seen == []  # not even a connection's request line
        await confined.aclose()
        default = EngineClient("engine-admin-token", 5.0)
        assert (await default.list_adapters(at(f"http://localhost:{port}"))).adapters == []  # loopback is fine
        start = time.monotonic()
        for url in ("http://169.254.169.254", "http://[::ffff:169.254.169.254]:80", "http://[fe80::1]:8000",
                    "http://[64:ff9b::a9fe:a9fe]", "http://[::a9fe:a9fe]", "http://[2002:a9fe:a9fe::1]",
                    "http://[::ffff:0:a9fe:a9fe]"):
            with pytest.raises(EngineCallError, match="egress refused: .*(metadata|link-local)"):
                await default.stats(at(url))
        assert time.monotonic() - start < 1.0  # refused at once, not retried or timed out
        await default.aclose()


async def test_an_unload_waits_for_the_engines_drain_which_it_bounds_by_its_deadline() -> None:
    seen: list[dict] = []
    deadline = 0.5

    async def draining_engine(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        await asyncio.sleep(1.5 * deadline)  # the adapter's requests in flight drain, longer than one deadline
        return httpx.Response(200, json={"name": "a", "drained": True, "aborted": 0})

    client = EngineClient(None, deadline, transport=httpx.MockTransport(draining_engine))
    unloaded = await client.unload(at("http://e:1"), "a")
    assert unloaded is not None and unloaded.drained
    assert seen == [{"lora_name": "a", "drain_timeout_s": deadline}]
