"""The console's URLs and its Fleet page's tenancy line in a real browser (Debian's chromium through Playwright) against a real `loraplane
control` process: an adapter's page at its natural address /ui/adapters/NAME (a name holding `/` too) as at
/ui/adapter?name=NAME; an unknown adapter there, and any unknown page under /ui, is the console's own
404 page with its navigation, while a 404 outside /ui stays the API's JSON error. With a real `loraplane
router --require-api-key` reporting, the Fleet page says tenancy is enforced there."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.e2e.test_control_plane_engines import ADMIN, control_plane
from tests.e2e.test_tenants import ROUTER_TOKEN, redis_ok, router_process
from tests.tools import require_tool

playwright = pytest.importorskip("playwright.sync_api")
TIMEOUT_MS = 30_000


def test_adapter_pages_at_their_natural_urls_and_friendly_404s(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = require_tool("chromium")
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    pirate = write_demo_adapters(base, root, names=["demo-pirate"])["demo-pirate"]
    expect.set_options(timeout=TIMEOUT_MS)
    if not redis_ok():
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    with control_plane(tmp_path, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN) as cp, sync_playwright() as pw:
        admin = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        for name in ("demo-pirate", "team-a/pirate"):  # registered; no engine holds them
            r = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(pirate)})
            assert r.status_code == 200, r.text
        outside = httpx.get(cp + "/v1/no-such-route", timeout=30)
        assert outside.status_code == 404 and outside.json()["error"]["type"] == "not_found_error", outside.text
        signed_out = httpx.get(cp + "/ui/no-such-page", timeout=30)  # no session: the page, without the nav
        assert signed_out.status_code == 404 and "no console page" in signed_out.text
        assert "<nav>" not in signed_out.text

        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(cp + "/ui/adapters/demo-pirate")  # no session yet: the sign-in page
        expect(page).to_have_url(cp + "/ui/login")
        page.fill("input[name=token]", ADMIN)
        page.click("button:text('Sign in')")
        expect(page).to_have_url(cp + "/ui/fleet")

        for name in ("demo-pirate", "team-a/pirate"):
            for url in (f"/ui/adapters/{name}", f"/ui/adapter?name={name}"):
                response = page.goto(cp + url)
                assert response is not None and response.status == 200, url
                expect(page.locator("h1")).to_contain_text(name)

        for url, says in (("/ui/adapters/no-such-adapter", "no-such-adapter"),
                          ("/ui/no-such-page", "no console page at /ui/no-such-page"),
                          ("/ui/adapters/demo-pirate/versions/1", "demo-pirate/versions/1")):
            response = page.goto(cp + url)
            assert response is not None and response.status == 404, url
            assert response.headers["content-type"].startswith("text/html"), url
            expect(page.get_by_role("alert")).to_contain_text(says)
            expect(page.locator("nav")).to_contain_text("Adapters")  # signed in: the console's navigation

        with router_process(cp, f"console-{tmp_path.name}", tmp_path / "router.log", "--router-name", "keyed"):
            page.goto(cp + "/ui/fleet")
            expect(page.locator("tr[data-router=keyed] [data-testid=keys]")).to_have_text("required")
            expect(page.get_by_test_id("tenancy")).to_contain_text("Tenancy is enforced")
            expect(page.get_by_test_id("tenancy")).to_contain_text("keyed")
        browser.close()

