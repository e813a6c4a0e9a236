"""The web console in a real browser: Debian's chromium driven by Playwright, against a real
`loraplane control` process and a real engine (the demo model, demo adapters) that registers itself.

Signs in (a wrong token first), sees the engine and the demo adapters, loads an adapter from the page and
watches it become placed on the engine (and the router beside it on the Fleet page), loads a second
version (the page says which token registered it), rolls back and activates version 2 again,
pins and unpins it, sees its requests in the charts (the control plane's own history), unloads it (the
engine lets it go); then a read token sees no admin buttons and a forged POST with its session is refused
(403, audited), with and without the CSRF token. No page logs a console error or throws. Screenshots of each page go to .artifacts/screenshots/ (git-ignored).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control_plane.auth import token_id
from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.data_plane.api.conftest import REPO_ROOT, SHARED_FLAGS, run_engine
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    _free_port,
    complete,
    control_plane,
    engine_auth,
    engine_token,
    started,
    wait_for,
)
from tests.tools import require_tool

playwright = pytest.importorskip("playwright.sync_api")

SCREENSHOTS = REPO_ROOT / ".artifacts" / "screenshots"
TIMEOUT_MS = 30_000
ROUTER_TOKEN = "console-test-router-token"


@pytest.fixture
def chromium() -> str:
    return require_tool("chromium")


@contextlib.contextmanager
def fleet(tmp: Path) -> Iterator[tuple[str, str, dict[str, Path]]]:
    """A control plane, one engine `e1` serving the demo model and a router `r1` reporting to it; its URL,
    the engine's API and the demo adapters' folders."""
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    paths = write_demo_adapters(base, root)
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp, root, LORAPLANE_UI_SESSION_SECRET="console-test-secret-0123456789",
                                               LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN))
        flags = ("--enable-lora", "--lora-roots", str(root), "--admin-token", engine_token("e1"), "--control-plane", cp,
                 *SHARED_FLAGS, "--engine-name", "e1")
        e1 = stack.enter_context(run_engine(base, tmp / "e1.log", *flags,
                                            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"]}))
        reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        wait_for(lambda: [e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]] == ["healthy"],
                 "the engine to register")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
               "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN}
        stack.enter_context(started([sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port",
                                     str(_free_port()), "--router-name", "r1"], tmp / "router.log", env,
                                    lambda: [r["state"] for r in reader.get(cp + "/v1/routers").json()["data"]]
                                    == ["up"], "the router to report"))
        yield cp, e1.api, paths


def held(engine_api: str) -> dict[str, dict]:
    listed = httpx.get(engine_api + "/lora_adapters", headers=engine_auth("e1"), timeout=10)
    return {a["name"]: a for a in listed.json()["adapters"] if a["state"] != "draining"}


def test_console_in_a_real_browser(tmp_path: Path, chromium: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    expect.set_options(timeout=TIMEOUT_MS)
    problems: list[str] = []
    with fleet(tmp_path) as (cp, engine_api, paths), sync_playwright() as pw:
        admin = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        for name in ("demo-poet", "demo-short"):  # registered and placed before the console opens
            r = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[name])})
            assert r.status_code == 200, r.text
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        def shot(name: str) -> None:
            page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

        def sign_in(token: str) -> None:
            page.goto(cp + "/ui/fleet")  # no session: the sign-in page
            expect(page).to_have_url(cp + "/ui/login")
            page.fill("input[name=token]", token)
            page.click("button:text('Sign in')")

        # a wrong token is told so, and gets no session
        sign_in("not-a-token-of-this-control-plane")
        expect(page.get_by_role("alert")).to_contain_text("not a read or admin token")
        shot("login")
        sign_in(ADMIN)
        expect(page).to_have_url(cp + "/ui/fleet")
        expect(page.get_by_test_id("role")).to_contain_text("admin")
        row = page.locator("tr[data-engine=e1]")
        expect(row).to_contain_text("healthy")
        expect(row).to_contain_text("demo")
        expect(page.locator("tr[data-router=r1]")).to_contain_text("up")
        expect(page.locator("tr[data-router=r1] [data-testid=keys]")).to_have_text("open")
        expect(page.get_by_test_id("tenancy")).to_contain_text("Tenancy is not enforced")
        shot("fleet")

        page.click("nav >> text=Adapters")
        for name in ("demo-poet", "demo-short"):
            expect(page.locator(f"tr[data-adapter={name}]")).to_contain_text("e1")
        shot("adapters")

        # load demo-pirate from the page: the adapter's page then shows it placed and loaded on e1
        form = page.get_by_test_id("load-form")
        form.locator("input[name=name]").fill("demo-pirate")
        form.locator("input[name=path]").fill(str(paths["demo-pirate"]))
        form.locator("button").click()
        expect(page.get_by_test_id("notice")).to_contain_text("Loaded demo-pirate version 1: e1 loaded")
        def observed(version: int):  # a placement row per engine and version (an old one desired absent)
            row = f"[data-testid=placements] tr[data-engine=e1][data-version='{version}']"
            return page.locator(f"{row} [data-testid=observed]")

        expect(observed(1)).to_have_text("loaded")
        assert "demo-pirate" in held(engine_api)

        # version 2 (other files), roll back to 1, activate 2 again: the page and the engine agree
        reload = page.get_by_test_id("reload-form")
        reload.locator("input[name=path]").fill(str(paths["demo-poet"]))
        reload.locator("button").click()
        expect(page.get_by_test_id("notice")).to_contain_text("version 2")
        expect(page.get_by_test_id("active-version")).to_have_text("v2")
        page.click("[data-action=rollback-1]")
        expect(page.get_by_test_id("notice")).to_contain_text("Version 1 of demo-pirate is active: e1 loaded")
        expect(page.get_by_test_id("active-version")).to_have_text("v1")
        page.click("[data-action=activate-2]")
        expect(page.get_by_test_id("active-version")).to_have_text("v2")
        expect(observed(2)).to_have_text("loaded")
        # who registered each version: the admin token this session signed in with (as audit rows name it)
        expect(page.locator("[data-testid=versions] tr[data-version='2']")).to_contain_text(f"admin:{token_id(ADMIN)}")
        placements = admin.get("/v1/lora_adapters/demo-pirate").json()["placements"]
        assert [(p["engine"], p["version"]) for p in placements if p["observed"] == "loaded"] == [("e1", 2)]
        page.click("[data-action=pin]")
        expect(page.get_by_test_id("pinned")).to_have_text("yes")
        page.click("[data-action=unpin]")
        expect(page.get_by_test_id("pinned")).to_have_text("no")

        # traffic in two rounds, a sample (every reconcile interval, 2 s) apart: the live charts draw it
        for _ in range(2):
            for _ in range(3):
                complete(engine_api, "demo-pirate")
            time.sleep(2.5)

        def charted() -> bool:  # no reload: the page refreshes its charts itself
            return page.evaluate("""() => ["tokens", "requests", "ttft"].every((key) => {
                const chart = Chart.getChart(document.getElementById("chart-" + key));
                return chart !== undefined && chart.data.datasets[0].data.some((v) => v > 0);
            })""")

        wait_for(charted, "the charts to show the requests", timeout_s=20)
        expect(page.locator("#chart-errors")).to_have_count(1)
        shot("adapter")

        page.click("[data-action=unload]")
        expect(page.get_by_test_id("notice")).to_contain_text("Unloaded demo-pirate: e1 unloaded")
        wait_for(lambda: "demo-pirate" not in held(engine_api), "the engine to let demo-pirate go")

        page.click("nav >> text=Audit")
        page.fill("input[name=adapter]", "demo-pirate")
        page.click("button:text('Filter')")
        for action in ("load_lora_adapter", "activate_lora_adapter", "pin_lora_adapter", "unload_lora_adapter"):
            expect(page.locator("[data-testid=audit]")).to_contain_text(action)
        shot("audit")

        # a read token: the same pages without admin buttons; a forged POST is 403 even with its CSRF token
        page.click("button:text('Sign out')")
        sign_in(READ)
        expect(page.get_by_test_id("role")).to_contain_text("read")
        page.goto(cp + "/ui/adapters")
        expect(page.get_by_test_id("load-form")).to_have_count(0)
        page.goto(cp + "/ui/adapter?name=demo-poet")
        expect(page.get_by_test_id("placements")).to_contain_text("e1")
        expect(page.get_by_test_id("admin-actions")).to_have_count(0)
        expect(page.locator("[data-action]")).to_have_count(0)
        shot("adapter-read-only")
        csrf = page.locator("input[name=csrf]").first.input_value()
        forged = {"action": "unload", "name": "demo-poet"}
        for form_data in ({"csrf": csrf, **forged}, forged):
            assert page.request.post(cp + "/ui/adapter", form=form_data).status == 403
        assert "demo-poet" in held(engine_api)
        refused = admin.get("/v1/audit", params={"adapter": "demo-poet", "action": "console_unload"}).json()["data"]
        assert [e["outcome"] for e in refused] == ["403 permission_error"]  # the one with a session's CSRF token
        browser.close()
    assert problems == [], "\n".join(problems)
