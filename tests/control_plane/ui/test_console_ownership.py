"""The console's adapters page in a real browser (Debian's chromium through Playwright) against a real
`loraplane control` process: an Owner column saying which tenant owns each adapter, public or private
(nobody's ones say so), and a filter by owner (a tenant's name, or `-` for the adapters nobody owns); the
adapter's own page says its owner too."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.e2e.test_control_plane_engines import ADMIN, READ, control_plane
from tests.tools import require_tool

playwright = pytest.importorskip("playwright.sync_api")
TIMEOUT_MS = 30_000


def test_adapters_page_shows_and_filters_by_owner(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = require_tool("chromium")
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    pirate = write_demo_adapters(base, tmp_path / "adapters", names=["demo-pirate"])["demo-pirate"]
    expect.set_options(timeout=TIMEOUT_MS)
    with control_plane(tmp_path, tmp_path / "adapters") as cp, sync_playwright() as pw:
        admin = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert admin.post("/v1/tenants", json={"name": "team-a"}).status_code == 201
        for name in ("a-private", "a-public", "free"):
            r = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(pirate),
                                                          "base_model": "demo"})
            assert r.status_code == 200, r.text
        for name, public in (("a-private", False), ("a-public", True)):
            assert admin.put(f"/v1/tenancy/adapters/{name}", json={"owner": "team-a", "public": public}).status_code == 200

        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(cp + "/ui/login")
        page.fill("input[name=token]", READ)  # reading is enough
        page.click("button:text('Sign in')")
        expect(page).to_have_url(cp + "/ui/fleet")
        page.goto(cp + "/ui/adapters")
        expect(page.locator("[data-testid=adapters] th").nth(2)).to_have_text("Owner")
        for name, says in (("a-private", "team-a private"), ("a-public", "team-a public"), ("free", "nobody")):
            expect(page.locator(f"tr[data-adapter={name}] [data-testid=owner]")).to_have_text(says)

        def rows() -> list[str]:
            return [row.get_attribute("data-adapter") or "" for row in page.locator("tr[data-adapter]").all()]

        for owner, shown in (("team-a", ["a-private", "a-public"]), ("-", ["free"])):
            page.fill("input[name=owner]", owner)
            page.click("button:text('Filter')")
            expect(page).to_have_url(f"{cp}/ui/adapters?search=&base_model=&label=&owner={owner}")
            expect(page.locator("tr[data-adapter]")).to_have_count(len(shown))
            assert rows() == shown
        page.fill("input[name=owner]", "team-b")
        page.click("button:text('Filter')")
        expect(page.get_by_text("No adapter matches.")).to_be_visible()

        page.goto(cp + "/ui/adapters/a-public")
        expect(page.get_by_test_id("owner")).to_have_text("team-a public")
        browser.close()
