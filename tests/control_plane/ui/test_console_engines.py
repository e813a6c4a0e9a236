"""The Fleet page's stale engines in a real browser (Debian's chromium through Playwright) against a real
`loraplane control` process and a real engine that registers, heartbeats and is then stopped.

The stopped engine reads `stale` (the API, `loraplane engines list`) and the Fleet page lists it apart;
a read session sees no Remove button and its forged POST is refused (403, audited); signing out ends the
session on the server (the copied cookie replayed afterwards lands on the sign-in page); an admin
session's POST without the CSRF token is refused, a dismissed confirmation removes nothing, an accepted
one removes the engine as DELETE /v1/engines/{name} does, and the audit trail shows who did it. An engine
of kind `vllm` shows its kind and its inference URL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from control_plane.auth import token_id
from data_plane.demo.model_builder import write_demo_model
from tests.data_plane.api.conftest import REPO_ROOT, SHARED_FLAGS, run_engine
from tests.e2e.test_control_plane_engines import ADMIN, CP_TOKENS, READ, control_plane, engine_token, wait_for
from tests.tools import require_tool

playwright = pytest.importorskip("playwright.sync_api")
TIMEOUT_MS = 30_000
COOKIE = "loraplane_console"


def test_a_stopped_engine_is_stale_and_an_admin_removes_it_from_the_fleet_page(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = require_tool("chromium")
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    expect.set_options(timeout=TIMEOUT_MS)
    with control_plane(tmp_path, tmp_path, LORAPLANE_ENGINE_STALE_AFTER_S="4") as cp, sync_playwright() as pw:
        admin = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)

        def states() -> dict[str, str]:
            return {e["name"]: e["state"] for e in admin.get("/v1/engines").json()["data"]}

        flags = ("--enable-lora", "--lora-roots", str(tmp_path), "--admin-token", engine_token("e1"), "--control-plane", cp,
                 "--engine-name", "e1",
                 "--heartbeat-interval-s", "1", *SHARED_FLAGS)
        with run_engine(base, tmp_path / "e1.log", *flags, env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"]}):
            wait_for(lambda: states() == {"e1": "healthy"}, "the engine to register")
        wait_for(lambda: states() == {"e1": "stale"}, "the stopped engine to read as stale")
        listed = _cli(cp, tmp_path, "engines", "list")
        assert listed.returncode == 0, listed.stderr
        assert [line.split() for line in listed.stdout.splitlines() if line.startswith("e1 ")][0][1] == "stale"

        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)

        def sign_in(token: str) -> None:
            page.goto(cp + "/ui/fleet")
            expect(page).to_have_url(cp + "/ui/login")
            page.fill("input[name=token]", token)
            page.click("button:text('Sign in')")
            expect(page).to_have_url(cp + "/ui/fleet")

        stale_row = page.locator("[data-testid=stale-engines] tr[data-engine=e1]")
        remove = stale_row.locator("[data-action=remove-engine]")

        # a read session: the stale engine listed apart, no button, and its forged POST refused and audited
        sign_in(READ)
        expect(stale_row.locator(".state")).to_have_text("stale")
        expect(page.get_by_test_id("engines")).to_have_count(0)  # no engine is current
        expect(page.locator("[data-action=remove-engine]")).to_have_count(0)
        csrf = page.locator("input[name=csrf]").first.input_value()
        forged = {"action": "remove_engine", "name": "e1"}
        assert page.request.post(cp + "/ui/fleet", form={"csrf": csrf, **forged}).status == 403
        refused = admin.get("/v1/audit", params={"action": "console_remove_engine"}).json()["data"]
        assert [(e["actor"], e["target"], e["outcome"]) for e in refused] == [
            (f"read:{token_id(READ)}", "e1", "403 permission_error")]

        # the console's sign-out button ends the session on the server: its copied cookie is worth nothing
        copied = [c for c in context.cookies() if c["name"] == COOKIE]
        assert len(copied) == 1
        page.click("button:text('Sign out')")
        expect(page).to_have_url(cp + "/ui/login")
        replay = browser.new_context()
        replay.add_cookies(copied)  # type: ignore[arg-type]
        replayed = replay.new_page()
        replayed.goto(cp + "/ui/fleet")
        expect(replayed).to_have_url(cp + "/ui/login")
        replay.close()

        # an admin session: the button; a POST without its CSRF token is refused and removes nothing
        sign_in(ADMIN)
        expect(remove).to_have_count(1)
        assert page.request.post(cp + "/ui/fleet", form=forged).status == 403
        assert states() == {"e1": "stale"}
        page.once("dialog", lambda dialog: dialog.dismiss())  # the confirmation declined: nothing is sent
        remove.click()
        expect(stale_row).to_have_count(1)
        assert states() == {"e1": "stale"}
        questions: list[str] = []
        page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.accept()))
        remove.click()
        expect(page.get_by_test_id("notice")).to_contain_text("Removed engine e1")
        assert "Remove engine e1" in questions[0]
        expect(stale_row).to_have_count(0)
        assert states() == {}

        # audited as the API's remove is: delete_engine by the admin token that signed in
        page.goto(cp + "/ui/audit?action=delete_engine")
        expect(page.locator("[data-testid=audit]")).to_contain_text(f"admin:{token_id(ADMIN)}")
        expect(page.locator("[data-testid=audit]")).to_contain_text("e1")

        # an engine of another kind, registered as `loraplane agent` registers a vLLM server: the page shows
        # its kind and where routers send its inference
        r = admin.post("/v1/engines/register", json={
            "name": "v1", "kind": "vllm", "url": "http://127.0.0.1:1", "inference_url": "http://127.0.0.1:2/",
            "base_model": "demo", "slots_total": 4})
        assert r.status_code == 200, r.text
        page.goto(cp + "/ui/fleet")
        agent_row = page.locator("tr[data-engine=v1]")
        expect(agent_row.locator("[data-testid=kind]")).to_have_text("vllm")
        expect(agent_row.locator("[data-testid=inference-url]")).to_have_text("inference: http://127.0.0.1:2")
        browser.close()
        trail = admin.get("/v1/audit", params={"action": "delete_engine"}).json()["data"]
        assert [(e["actor"], e["target"], e["outcome"]) for e in trail] == [(f"admin:{token_id(ADMIN)}", "e1", "ok")]


def _cli(cp: str, tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`loraplane ARGV` as an operator runs it, with the read token in the environment."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
           "LORAPLANE_URL": cp, "LORAPLANE_TOKEN": READ, "LORAPLANE_CONFIG": str(tmp / "no-profiles.toml")}
    return subprocess.run([sys.executable, "-m", "shared.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env=env)
