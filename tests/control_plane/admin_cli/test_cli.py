"""The admin CLI as an operator runs it: `python -m shared.cli adapters|engines|stats|audit …` in a
subprocess, against a real `loraplane control` process (SQLite) with one real engine registered (e1) and,
for partial pushes, one registered at an address nobody answers. URL and token come from the
environment (LORAPLANE_URL, LORAPLANE_TOKEN) or a profile file, never from a flag.

Checked: load, list, show, upload, pin and unpin (seen on the engine itself), activate, unload, delete,
engines list (with each engine's kind)/drain/remove/token, stats (and --watch), audit; exit code 1 and the failed engine named on a push
that reached only some engines, 2 with the server's message on a 404 and on a read token's 403."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.control_plane.domain.adapters.helpers import UNREACHABLE
from tests.data_plane.api.conftest import REPO_ROOT, SHARED_FLAGS, EngineServer, run_engine
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    ENGINE_SECRET,
    READ,
    control_plane,
    engine_auth,
    engine_token,
    wait_for,
)


@dataclass
class Fleet:
    url: str
    engine: EngineServer
    adapters: dict[str, Path]
    tmp: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("admin-cli")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    adapters = write_demo_adapters(base, root)
    with control_plane(tmp, root) as url:
        env = {"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"]}
        with run_engine(base, tmp / "e1.log", "--enable-lora", "--lora-roots", str(root), "--admin-token",
                        engine_token("e1"), "--control-plane", url, "--engine-name", "e1", *SHARED_FLAGS, env=env) as e1:
            wait_for(lambda: [e["name"] for e in httpx.get(f"{url}/v1/engines", timeout=5, headers={
                "Authorization": f"Bearer {READ}"}).json()["data"]] == ["e1"], "e1 to register")
            yield Fleet(url, e1, adapters, tmp)


def cli(fleet: Fleet, *argv: str, token: str | None = ADMIN, **env: str) -> subprocess.CompletedProcess[str]:
    """`loraplane ARGV` with the control plane's URL and `token` in the environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    clean.update({"LORAPLANE_URL": fleet.url, "LORAPLANE_CONFIG": str(fleet.tmp / "no-profiles.toml"), **env})
    if token is not None:
        clean["LORAPLANE_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "shared.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env=clean)


def ok(result: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def as_json(result: subprocess.CompletedProcess[str], code: int = 0) -> dict:
    return json.loads(ok(result, code).stdout)


def on_engine(fleet: Fleet) -> dict[str, bool]:
    """What the engine itself holds: adapter name -> pinned."""
    listed = httpx.get(fleet.engine.api + "/lora_adapters", headers=engine_auth("e1"), timeout=10).json()["adapters"]
    return {a["name"]: a["pinned"] for a in listed}


def test_the_adapter_lifecycle_from_the_cli(fleet: Fleet) -> None:
    assert as_json(cli(fleet, "adapters", "list", "--json"))["data"] == []
    loaded = as_json(cli(fleet, "adapters", "load", "pirate", str(fleet.adapters["demo-pirate"]), "--base-model",
                         "demo", "--label", "team=ops", "--json"))
    assert [(e["engine"], e["outcome"]) for e in loaded["engines"]] == [("e1", "loaded")]
    assert on_engine(fleet) == {"pirate": False}
    table = ok(cli(fleet, "adapters", "list")).stdout
    assert "NAME" in table and "pirate" in table and "team=ops" in table and "1 of 1" in table

    shown = as_json(cli(fleet, "adapters", "show", "pirate", "--json"))
    assert shown["active_version"] == 1 and shown["pinned"] is False
    assert [(p["engine"], p["desired"], p["observed"]) for p in shown["placements"]] == [("e1", "loaded", "loaded")]
    assert "placements" in ok(cli(fleet, "adapters", "show", "pirate")).stdout

    pinned = as_json(cli(fleet, "adapters", "pin", "pirate", "--json"))
    assert pinned["pinned"] is True and [e["outcome"] for e in pinned["engines"]] == ["loaded"]
    assert on_engine(fleet) == {"pirate": True}
    assert "pinned" in ok(cli(fleet, "adapters", "unpin", "pirate")).stdout
    assert on_engine(fleet) == {"pirate": False}

    # a new version (uploaded from this machine's folder) is active at once; roll back to 1
    up = as_json(cli(fleet, "adapters", "upload", "pirate", str(fleet.adapters["demo-poet"]), "--json"))
    assert up["version"] == 2 and [e["outcome"] for e in up["engines"]] == ["loaded"]
    rolled = as_json(cli(fleet, "adapters", "activate", "pirate", "1", "--json"))
    assert rolled["active_version"] == 1 and [e["outcome"] for e in rolled["engines"]] == ["loaded"]

    assert "e1" in ok(cli(fleet, "adapters", "unload", "pirate")).stdout
    assert on_engine(fleet) == {}
    assert "deleted pirate version 2" in ok(cli(fleet, "adapters", "delete", "pirate", "--version", "2")).stdout
    ok(cli(fleet, "adapters", "delete", "pirate"))
    assert as_json(cli(fleet, "adapters", "list", "--json"))["total"] == 0

    trail = as_json(cli(fleet, "audit", "--adapter", "pirate", "--json"))["data"]
    assert [(e["action"], e["target"], e["outcome"]) for e in reversed(trail)] == [
        ("load_lora_adapter", "pirate", "ok"), ("pin_lora_adapter", "pirate", "ok"),
        ("unpin_lora_adapter", "pirate", "ok"), ("upload_lora_adapter", "pirate", "ok"),
        ("activate_lora_adapter", "pirate@1", "ok"), ("unload_lora_adapter", "pirate", "ok"),
        ("delete_lora_adapter_version", "pirate@2", "ok"), ("delete_lora_adapter", "pirate", "ok")]
    table = ok(cli(fleet, "audit", "--action", "pin_lora_adapter")).stdout
    assert "pin_lora_adapter" in table and "unpin_lora_adapter" not in table


def test_errors_say_the_servers_message_and_exit_2(fleet: Fleet) -> None:
    missing = ok(cli(fleet, "adapters", "show", "no-such-adapter"), 2)
    assert "404" in missing.stderr and "no adapter named 'no-such-adapter' is registered" in missing.stderr
    assert missing.stdout == ""
    body = as_json(cli(fleet, "adapters", "pin", "no-such-adapter", "--json"), 2)
    assert body["error"]["type"] == "not_found_error"
    refused = ok(cli(fleet, "adapters", "unload", "x", token=READ), 2)
    assert "403 permission_error" in refused.stderr
    assert "401" in ok(cli(fleet, "engines", "list", token=None), 2).stderr
    unreachable = ok(cli(fleet, "engines", "list", LORAPLANE_URL=UNREACHABLE), 2)
    assert "cannot reach the control plane at http://127.0.0.1:1" in unreachable.stderr
    assert ok(cli(fleet, "adapters", "activate", "x", "zero"), 2).stderr  # click's usage error


def test_engines_token_prints_the_token_the_engine_takes_without_calling_the_control_plane(fleet: Fleet) -> None:
    nowhere = {"LORAPLANE_URL": "http://127.0.0.1:9"}  # computed locally: no control plane needed
    printed = ok(cli(fleet, "engines", "token", "e1", token=None, LORAPLANE_ENGINE_ADMIN_TOKEN=ENGINE_SECRET, **nowhere))
    token = printed.stdout.strip()
    assert token and ENGINE_SECRET not in printed.stdout
    listed = httpx.get(fleet.engine.api + "/lora_adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert listed.status_code == 200, listed.text
    other = ok(cli(fleet, "engines", "token", "e2", token=None, LORAPLANE_ENGINE_ADMIN_TOKEN=ENGINE_SECRET, **nowhere))
    refused = httpx.get(fleet.engine.api + "/lora_adapters", timeout=10,
                        headers={"Authorization": f"Bearer {other.stdout.strip()}"})
    assert refused.status_code == 403
    unset = ok(cli(fleet, "engines", "token", "e1", **nowhere), 2)
    assert "set LORAPLANE_ENGINE_ADMIN_TOKEN" in unset.stderr and unset.stdout == ""
    unreadable = ok(cli(fleet, "engines", "token", "e1", LORAPLANE_ENGINE_ADMIN_TOKEN_FILE=str(fleet.tmp / "nope")), 2)
    assert "LORAPLANE_ENGINE_ADMIN_TOKEN_FILE: cannot read" in unreadable.stderr and unreadable.stdout == ""
    bad_name = ok(cli(fleet, "engines", "token", "../e1", LORAPLANE_ENGINE_ADMIN_TOKEN=ENGINE_SECRET), 2)
    assert "not an engine name" in bad_name.stderr and bad_name.stdout == ""


def test_a_push_that_reaches_some_engines_exits_1_and_engines_drain_and_go(fleet: Fleet) -> None:
    r = httpx.post(f"{fleet.url}/v1/engines/register", timeout=30, headers={"Authorization": f"Bearer {ADMIN}"},
                   json={"name": "dead", "kind": "vllm", "url": UNREACHABLE, "inference_url": "http://127.0.0.1:2",
                         "base_model": "demo", "slots_total": 4})
    assert r.status_code == 200, r.text
    try:
        partial = cli(fleet, "adapters", "load", "poet", str(fleet.adapters["demo-poet"]), "--base-model", "demo",
                      "--engine", "e1", "--engine", "dead")
        ok(partial, 1)
        assert "207: 1 of 2 engines failed (dead)" in partial.stderr
        assert "dead" in partial.stdout and "failed" in partial.stdout and "loaded" in partial.stdout
        body = as_json(cli(fleet, "adapters", "pin", "poet", "--json"), 1)
        assert {e["engine"]: e["outcome"] for e in body["engines"]} == {"e1": "loaded", "dead": "failed"}
        assert on_engine(fleet) == {"poet": True}

        listed = {e["name"]: e["state"] for e in as_json(cli(fleet, "engines", "list", "--json"))["data"]}
        assert listed == {"dead": "healthy", "e1": "healthy"}
        rows = {line.split()[0]: line.split() for line in ok(cli(fleet, "engines", "list")).stdout.splitlines()[1:]}
        assert (rows["e1"][2], rows["dead"][2]) == ("loraplane", "vllm")  # NAME STATE KIND …
        assert rows["dead"][-2:] == [UNREACHABLE, "http://127.0.0.1:2"] and rows["e1"][-1] == "-"  # URL, INFERENCE URL
        assert "dead: draining" in ok(cli(fleet, "engines", "drain", "dead")).stdout
        assert "draining" in ok(cli(fleet, "engines", "list")).stdout
        assert "removed dead" in ok(cli(fleet, "engines", "remove", "dead")).stdout
        assert "404" in ok(cli(fleet, "engines", "drain", "dead"), 2).stderr
        trail = as_json(cli(fleet, "audit", "--json", "--limit", "3"))["data"]
        assert [(e["action"], e["target"], e["outcome"]) for e in trail] == [
            ("drain_engine", "dead", "404 not_found_error"), ("delete_engine", "dead", "ok"),
            ("drain_engine", "dead", "ok")]

        stats = as_json(cli(fleet, "stats", "--json"))
        assert [e["engine"] for e in stats["engines"]] == ["e1"]
        watched = ok(cli(fleet, "stats", "--watch", "--count", "2", "--interval", "0.1", "--json")).stdout
        assert [sorted(json.loads(line)) for line in watched.splitlines()] == [["adapters", "engines"]] * 2
        assert "ADAPTER" in ok(cli(fleet, "stats")).stdout
    finally:
        cli(fleet, "engines", "remove", "dead")
        cli(fleet, "adapters", "unload", "poet")


def test_a_profile_file_gives_url_and_token(fleet: Fleet) -> None:
    profiles = fleet.tmp / "profiles.toml"
    profiles.write_text(f'[default]\nurl = "{UNREACHABLE}"\n\n[lab]\nurl = "{fleet.url}"\ntoken = "{READ}"\n')
    profiles.chmod(0o600)
    env = {"LORAPLANE_CONFIG": str(profiles), "LORAPLANE_URL": ""}
    assert "e1" in ok(cli(fleet, "engines", "list", "--profile", "lab", token=None, **env)).stdout
    assert ok(cli(fleet, "engines", "list", token=None, **env), 2).stderr.count("cannot reach") == 1
    assert "no profile 'prod'" in ok(cli(fleet, "engines", "list", "--profile", "prod", token=None, **env), 2).stderr
    # the environment wins over the profile
    assert "e1" in ok(cli(fleet, "engines", "list", token=READ, **{**env, "LORAPLANE_URL": fleet.url})).stdout
