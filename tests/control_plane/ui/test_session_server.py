"""Console sessions against a real `loraplane control` over HTTP: the cookie is Secure when the request
came over https (X-Forwarded-Proto counts only from a trusted proxy, FORWARDED_ALLOW_IPS), signing out
ends the session on the server (a replayed cookie is refused), and failed sign-ins are limited per
address and audited.

The control plane trusts 127.0.0.2 as its proxy; clients bound to 127.0.0.2 (the proxy) and 127.0.0.1
(anyone else) reach it over loopback."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.test_control_plane_engines import ADMIN, READ, control_plane

PROXY, OTHER = "127.0.0.2", "127.0.0.1"
FAILURES = 3  # LORAPLANE_KEY_FAILURES_PER_ADDRESS


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("console-sessions")
    with control_plane(tmp, tmp, FORWARDED_ALLOW_IPS=PROXY, LORAPLANE_UI_SESSION_SECRET="s" * 32,
                       LORAPLANE_KEY_FAILURES_PER_ADDRESS=str(FAILURES)) as url:
        yield url


def browser(url: str, source: str = OTHER) -> httpx.Client:
    return httpx.Client(base_url=url, follow_redirects=False, timeout=10,
                        transport=httpx.HTTPTransport(local_address=source))


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


def sign_in(client: httpx.Client, token: str, **headers: str) -> httpx.Response:
    """The sign-in form, sent back with its own cookie as a browser would (behind a TLS proxy, the client's
    jar here would keep a Secure cookie off this plain-http hop)."""
    page = client.get("/ui/login", headers=headers)
    login_csrf = set_cookie(page, "loraplane_console_login").split(";", 1)[0]
    return client.post("/ui/login", data={"csrf": _csrf(page.text), "token": token},
                       headers={**headers, "Cookie": login_csrf})


def set_cookie(response: httpx.Response, name: str = "loraplane_console") -> str:
    lines = [v for v in response.headers.get_list("set-cookie") if v.startswith(name + "=")]
    assert len(lines) == 1, response.headers
    return lines[0]


def test_the_cookie_is_secure_over_https_as_a_trusted_proxy_says(cp: str) -> None:
    with browser(cp) as plain:
        assert "secure" not in set_cookie(sign_in(plain, READ)).lower()  # plain http: a Secure cookie would be lost
    with browser(cp, PROXY) as behind_tls:  # the proxy that ended TLS says so
        r = sign_in(behind_tls, READ, **{"X-Forwarded-Proto": "https"})
        assert r.status_code == 303 and "; secure" in set_cookie(r).lower(), r.headers
        assert "; secure" in set_cookie(behind_tls.get("/ui/login", headers={"X-Forwarded-Proto": "https"}),
                                        "loraplane_console_login").lower()
    with browser(cp) as pretender:  # anyone else's X-Forwarded-Proto is ignored
        r = sign_in(pretender, READ, **{"X-Forwarded-Proto": "https"})
        assert r.status_code == 303 and "secure" not in set_cookie(r).lower()


def test_signing_out_ends_the_session_on_the_server(cp: str) -> None:
    with browser(cp) as client:
        assert sign_in(client, ADMIN).headers["location"] == "/ui/fleet"
        copied = client.cookies["loraplane_console"]
        fleet = client.get("/ui/fleet")
        assert fleet.status_code == 200
        out = client.post("/ui/logout", data={"csrf": _csrf(fleet.text)})
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    with browser(cp) as replay:  # the cookie as it was before signing out
        replay.cookies.set("loraplane_console", copied, path="/ui")
        r = replay.get("/ui/fleet")
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"
        assert replay.post("/ui/logout", data={"csrf": "x"}).status_code == 403
    with browser(cp) as again:  # the same token signs in anew
        assert sign_in(again, ADMIN).status_code == 303 and again.get("/ui/fleet").status_code == 200


def test_failed_sign_ins_are_limited_per_address_and_audited(cp: str) -> None:
    with browser(cp, PROXY) as guesser:
        forwarded = {"X-Forwarded-For": "203.0.113.7"}  # the client the proxy forwards
        for _ in range(FAILURES):
            r = sign_in(guesser, "not-a-token", **forwarded)
            assert r.status_code == 303 and "error=" in r.headers["location"]
        r = sign_in(guesser, ADMIN, **forwarded)  # even the right token: this address is refused for now
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "Too many failed sign-ins" in r.text
        assert sign_in(guesser, ADMIN).status_code == 303  # another address (the proxy's own) is not
    events = httpx.get(f"{cp}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()["data"]
    failed = [e for e in events if e["action"] == "console_sign_in"]
    assert len(failed) == FAILURES, failed
    assert {(e["actor"], e["outcome"]) for e in failed} == {("address:203.0.113.7", "401 authentication_error")}
    assert "not-a-token" not in str(events)
