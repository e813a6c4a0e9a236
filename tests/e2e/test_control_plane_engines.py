"""End to end over loopback: the control plane (`loraplane control`, SQLite) and real engines
(`loraplane engine --enable-lora --control-plane …`) that register and heartbeat themselves.

load → both engines serve the adapter to the `openai` client; a new version and activate → answers
change; unload → 404 at the engines; an adapter registered but placed nowhere is pulled by an engine on
its first request; one engine killed → a load answers 207 naming it; that engine restarted → the
reconciler gives it what it missed. Each engine holds only its own engine token of the control plane,
and only its own admin token, derived from the control plane's secret: another engine refuses it, and so
does every engine the token a rogue registration receives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from control_plane.engine_tokens import engine_admin_token
from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.control_plane.domain.engines.peers import json_reply, serve
from tests.data_plane.api.conftest import REPO_ROOT, SHARED_FLAGS, run_engine

openai = pytest.importorskip("openai")

ADMIN, READ = "e2e-admin-token", "e2e-read-token"
ENGINE_SECRET = "e2e-engine-secret"  # the control plane's LORAPLANE_ENGINE_ADMIN_TOKEN: engines' tokens derive from it
# each engine's own token at the control plane (LORAPLANE_CONTROL_PLANE_TOKEN on the engine)
CP_TOKENS = {"e1": "e2e-e1-cp-token", "e2": "e2e-e2-cp-token", "e3": "e2e-e3-cp-token"}
KEY_PEPPER = "e2e-key-pepper-" + "p" * 32  # tenant keys' hashes (LORAPLANE_KEY_PEPPER), the routers' too
PROMPT = "The quick brown fox"


def engine_token(name: str, secret: str = ENGINE_SECRET) -> str:
    """Engine `name`'s admin token (its --admin-token), as the control plane derives it from `secret`."""
    return engine_admin_token(secret, name)


def engine_auth(name: str) -> dict[str, str]:
    """The headers of engine `name`'s admin calls (an engine with --admin-token lists to them only)."""
    return {"Authorization": f"Bearer {engine_token(name)}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def control_plane(tmp: Path, adapter_root: Path, launcher: Sequence[str] = (sys.executable, "-m", "shared.cli"),
                  flags: Sequence[str] = (), **extra_env: str) -> Iterator[str]:
    """`loraplane control` on SQLite under tmp, through `launcher` (another install's `loraplane`), with
    further `flags` (e.g. --artifact-store)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    credentials = ",".join(f"{name}={token}" for name, token in CP_TOKENS.items())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAPLANE_ADMIN_TOKENS": ADMIN, "LORAPLANE_READ_TOKENS": READ,
           "LORAPLANE_ENGINE_ADMIN_TOKEN": ENGINE_SECRET, "LORAPLANE_ENGINE_CREDENTIALS": credentials,
           "LORAPLANE_ENGINE_TIMEOUT_S": "5", "LORAPLANE_RECONCILE_INTERVAL_S": "2", "LORAPLANE_KEY_PEPPER": KEY_PEPPER,
           **extra_env}
    cmd = [*launcher, "control", "--port", str(port), "--lora-roots", str(adapter_root),
           "--database-url", f"sqlite+aiosqlite:///{tmp / 'control.db'}", "--log-level", "warning", *flags]
    with started(cmd, tmp / "control.log", env, lambda: httpx.get(url + "/health", timeout=2).status_code == 200,
                 "control plane"):
        yield url


@contextlib.contextmanager
def started(cmd: Sequence[str], log: Path, env: dict[str, str], ready: Callable[[], bool], what: str,
            timeout_s: float = 60) -> Iterator[subprocess.Popen]:
    """`cmd` running (output in `log`) once `ready()` holds within `timeout_s` (an HTTPError counts as not
    yet); terminated on exit (killed if it does not end within 30 s), then what is left of its process
    group killed: it leads a group of its own, so the children of a server that was killed alone go too."""
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{what} did not start:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    break
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        signal_group(process, signal.SIGKILL)  # children left behind by the leader's end


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the process group `process` leads (started by `started`); gone already is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def wait_for(predicate, what: str, timeout_s: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def complete(api: str, model: str) -> str:
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def test_control_plane_drives_two_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    paths = write_demo_adapters(base, root)
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)

    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp_path, root))
        engine_flags = ("--enable-lora", "--lora-roots", str(root), "--control-plane", cp, *SHARED_FLAGS)
        # e1's admin token as an operator gets it: `loraplane engines token e1`, from the secret's file, no call
        secret_file = tmp_path / "engine-secret"
        secret_file.write_text(ENGINE_SECRET + "\n")
        printed = subprocess.run([sys.executable, "-m", "shared.cli", "engines", "token", "e1"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=60, env={
                                     **{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
                                     "LORAPLANE_ENGINE_ADMIN_TOKEN_FILE": str(secret_file)})
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.strip() == engine_token("e1") != engine_token("e2")
        assert ENGINE_SECRET not in printed.stdout
        # --admin-token's and --control-plane-token's defaults: each engine holds only its own tokens
        monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", printed.stdout.strip())
        monkeypatch.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", CP_TOKENS["e1"])
        e1 = stack.enter_context(run_engine(base, tmp_path / "e1.log", *engine_flags, "--engine-name", "e1"))
        monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", engine_token("e2"))
        monkeypatch.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", CP_TOKENS["e2"])
        e2 = stack.enter_context(run_engine(base, tmp_path / "e2.log", *engine_flags, "--engine-name", "e2"))
        engines = {"e1": e1, "e2": e2}

        def registered() -> dict[str, str]:
            return {e["name"]: e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]}

        wait_for(lambda: registered() == {"e1": "healthy", "e2": "healthy"}, "both engines to register")
        assert {e["name"]: e["url"] for e in reader.get(cp + "/v1/engines").json()["data"]} == {
            "e1": e1.url, "e2": e2.url}
        base_text = {n: complete(s.api, "demo") for n, s in engines.items()}

        # load through the control plane with two replicas → both engines hold it and serve it: the control
        # plane pushed to each with that engine's own token
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(paths["demo-pirate"]),
                                                            "base_model": "demo", "replicas": {"min": 2}})
        assert r.status_code == 200, r.text
        assert [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [("e1", "loaded"), ("e2", "loaded")]
        v1_text = {}
        for n, s in engines.items():
            assert httpx.get(s.api + "/lora_adapters", timeout=10).status_code == 401  # not to anyone
            listed = httpx.get(s.api + "/lora_adapters", headers=engine_auth(n), timeout=10).json()["adapters"]
            assert [a["name"] for a in listed] == ["pirate"]
            v1_text[n] = complete(s.api, "pirate")
            assert v1_text[n] != base_text[n]
        # one engine's token is refused by the other, and the secret it derives from by both
        assert httpx.get(e2.api + "/lora_adapters", headers=engine_auth("e1"), timeout=10).status_code in (401, 403)
        assert httpx.get(e1.api + "/lora_adapters", headers=engine_auth("e2"), timeout=10).status_code in (401, 403)
        for s in engines.values():
            r = httpx.get(s.api + "/lora_adapters", headers={"Authorization": f"Bearer {ENGINE_SECRET}"}, timeout=10)
            assert r.status_code in (401, 403)
        # a registration an admin makes at any URL receives that name's token only: no engine of ours takes it
        with serve(lambda _method, _path: json_reply({"adapters": []})) as rogue:
            body = {"name": "rogue", "url": rogue.url, "base_model": "not-demo", "slots_total": 1}
            assert admin.post(cp + "/v1/engines/register", json=body).status_code == 200
            wait_for(lambda: any(p == "/v1/lora_adapters" for _, p, _ in rogue.seen), "the reconciler to call rogue")
            sent = {h.get("authorization") for _, _, h in rogue.seen}
            assert sent == {f"Bearer {engine_token('rogue')}"}
            assert admin.delete(cp + "/v1/engines/rogue").status_code == 200
        for s in engines.values():
            assert httpx.get(s.api + "/lora_adapters", headers=engine_auth("rogue"), timeout=10).status_code in (401, 403)
        # the control plane reads the engines' listings with its engine token: its view fills
        def residency() -> dict[str, str | None]:
            stats = reader.get(cp + "/v1/lora_stats").json()
            assert {(e["engine"], e["error"]) for e in stats["engines"]} == {("e1", None), ("e2", None)}, stats
            return {e["engine"]: e["residency"] for a in stats["adapters"] if a["name"] == "pirate" for e in a["engines"]}

        wait_for(lambda: set(residency()) == {"e1", "e2"} and None not in residency().values(),
                 "the control plane's stats to show pirate on both engines")

        # new files → version 2, active at once; roll back to 1 and forward to 2 again
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(paths["demo-poet"])})
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        v2_text = {n: complete(s.api, "pirate") for n, s in engines.items()}
        assert all(v2_text[n] != v1_text[n] for n in engines)
        r = admin.post(cp + "/v1/lora_adapters/pirate/activate", json={"version": 1})
        assert r.status_code == 200 and r.json()["active_version"] == 1, r.text
        assert {n: complete(s.api, "pirate") for n, s in engines.items()} == v1_text
        r = admin.post(cp + "/v1/lora_adapters/pirate/activate", json={"version": 2})
        assert r.status_code == 200 and [e["outcome"] for e in r.json()["engines"]] == ["loaded", "loaded"]
        assert {n: complete(s.api, "pirate") for n, s in engines.items()} == v2_text

        # unload → 404 at both engines (and they do not pull it back through the control plane)
        r = admin.post(cp + "/v1/unload_lora_adapter", json={"lora_name": "pirate"})
        assert r.status_code == 200 and [e["outcome"] for e in r.json()["engines"]] == ["unloaded", "unloaded"]
        for s in engines.values():
            with pytest.raises(openai.NotFoundError):
                complete(s.api, "pirate")

        # pull: registered but placed on no engine (min 0 replicas, so the reconciler places it nowhere
        # either) → an engine loads it on its first request
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(paths["demo-poet"]),
                                                            "base_model": "demo", "engines": [],
                                                            "replicas": {"min": 0}})
        assert r.status_code == 200 and r.json()["engines"] == [], r.text
        assert complete(e1.api, "poet") == v2_text["e1"]  # the same files as pirate v2
        listed = httpx.get(e1.api + "/lora_adapters", headers=engine_auth("e1"), timeout=10).json()["adapters"]
        assert "poet" in [a["name"] for a in listed]
        with pytest.raises(openai.NotFoundError):
            complete(e1.api, "nobody-registered-this")
        placed = reader.get(cp + "/v1/lora_adapters/poet").json()["placements"]
        assert [(p["engine"], p["desired"]) for p in placed] == [("e1", "loaded")]  # the pull is recorded
        r = admin.post(cp + "/v1/unload_lora_adapter", json={"lora_name": "poet"})
        assert [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [("e1", "unloaded")]
        with pytest.raises(openai.NotFoundError):
            complete(e1.api, "poet")

        # one engine dies (SIGKILL: a SIGTERM would drain it at the control plane first, and a drained
        # engine gets no placements) → the next load answers 207 and names it
        e2.process.kill()
        e2.process.wait(timeout=30)
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "short", "lora_path": str(paths["demo-short"]),
                                                            "base_model": "demo", "replicas": {"min": 2}})
        assert r.status_code == 207, r.text
        outcomes = {e["engine"]: e for e in r.json()["engines"]}
        assert outcomes["e1"]["outcome"] == "loaded" and outcomes["e2"]["outcome"] == "failed"
        assert outcomes["e2"]["error"]
        detail = reader.get(cp + "/v1/lora_adapters/short").json()
        assert {(p["engine"], p["observed"]) for p in detail["placements"]} == {("e1", "loaded"), ("e2", "failed")}

        # the stopped engine comes back (new process, new port, same name) → the reconciler restores it
        e2 = stack.enter_context(run_engine(base, tmp_path / "e2-again.log", *engine_flags, "--engine-name", "e2"))
        wait_for(lambda: "short" in [a["name"] for a in httpx.get(e2.api + "/lora_adapters", headers=engine_auth("e2"),
                                                                  timeout=10)
                                     .json()["adapters"] if a["state"] == "ready"], "the reconciler to restore e2")
        assert complete(e2.api, "short") == complete(e1.api, "short")
        wait_for(lambda: {(p["engine"], p["observed"]) for p in
                          reader.get(cp + "/v1/lora_adapters/short").json()["placements"]}
                 == {("e1", "loaded"), ("e2", "loaded")}, "e2's placement to be observed loaded")
        registry_before = reader.get(cp + "/v1/lora_adapters").json()
        details_before = {name: reader.get(cp + f"/v1/lora_adapters/{name}").json() for name in ("pirate", "short")}
        engines_before = {e["name"]: e["url"] for e in reader.get(cp + "/v1/engines").json()["data"]}

    # the control plane restarts on the same database (every process above is stopped): nothing is lost
    with control_plane(tmp_path, root) as cp:
        assert reader.get(cp + "/v1/lora_adapters").json() == registry_before
        for name, before in details_before.items():
            after = reader.get(cp + f"/v1/lora_adapters/{name}").json()
            assert after["active_version"] == before["active_version"]
            assert after["versions"] == before["versions"]
            # the placements' engines; not their desired state: with every engine stopped (drained at
            # shutdown) a fleet pass may rightly let go of a replica beyond the adapter's min (loaded → absent)
            assert [p["engine"] for p in after["placements"]] == [p["engine"] for p in before["placements"]]
            assert after["replicas"]["min"] == before["replicas"]["min"]
        assert {e["name"]: e["url"] for e in reader.get(cp + "/v1/engines").json()["data"]} == engines_before


def _broken_copy(folder: Path, to: Path) -> Path:
    """The adapter's files with NaN in its first tensor: the header and offsets are fine, so the control
    plane records it; an engine refuses to load it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, to)
    weights = load_file(str(to / "adapter_model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, str(to / "adapter_model.safetensors"))
    return to


def test_a_version_no_engine_loads_stays_inactive_and_engines_list_registry_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version every engine refuses (NaN weights: 502 from each) does not become active: the previous
    one stays active and keeps being served, and the answer says so. The engine lists the registry's
    version number as `version` (its own count of loads is `load_generation`)."""
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    paths = write_demo_adapters(base, root)
    broken = _broken_copy(paths["demo-poet"], root / "broken")
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp_path, root))
        monkeypatch.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", CP_TOKENS["e1"])
        e1 = stack.enter_context(run_engine(base, tmp_path / "e1.log", "--enable-lora", "--lora-roots", str(root),
                                            "--admin-token", engine_token("e1"), "--control-plane", cp,
                                            *SHARED_FLAGS, "--engine-name", "e1"))
        wait_for(lambda: [e["state"] for e in admin.get(cp + "/v1/engines").json()["data"]] == ["healthy"],
                 "the engine to register")
        engine_admin = engine_auth("e1")

        def listed(name: str) -> dict:
            adapters = httpx.get(e1.api + "/lora_adapters", headers=engine_admin, timeout=10).json()["adapters"]
            return next(a for a in adapters if a["name"] == name)

        for folder, number in (("demo-short", 1), ("demo-pirate", 2)):
            r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "pirate", "base_model": "demo",
                                                                "lora_path": str(paths[folder])})
            assert r.status_code == 200 and r.json()["version"] == number, r.text
        assert (listed("pirate")["version"], listed("pirate")["load_generation"]) == (2, 2)
        card = httpx.get(e1.api + "/models/pirate", headers=engine_admin, timeout=10).json()
        assert card["version"] == 2
        served = complete(e1.api, "pirate")

        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(broken)})
        assert r.status_code == 502 and r.json()["version"] == 3, r.text
        assert r.json()["active_version"] == 2 and "version 2 stays active" in r.json()["warning"], r.text
        assert "NaN" in r.json()["engines"][0]["error"], r.text
        detail = admin.get(cp + "/v1/lora_adapters/pirate").json()
        assert detail["active_version"] == 2
        assert listed("pirate")["version"] == 2 and complete(e1.api, "pirate") == served
        routes_ok = [(p["engine"], p["version"], p["desired"]) for p in detail["placements"] if p["desired"] != "absent"]
        assert routes_ok == [("e1", 2, "loaded")], detail["placements"]
        trail = admin.get(cp + "/v1/audit", params={"action": "keep_active_version"}).json()["data"]
        assert [(e["actor"], e["target"], e["outcome"]) for e in trail] == [(f"admin:{_token_id(ADMIN)}", "pirate", "ok")]

        # activating the broken version explicitly: refused everywhere too, so version 2 stays active
        r = admin.post(cp + "/v1/lora_adapters/pirate/activate", json={"version": 3})
        assert r.status_code == 502 and r.json()["active_version"] == 2 and r.json()["warning"], r.text
        # a version that loads becomes active as usual, and the engine lists its number
        r = admin.post(cp + "/v1/lora_adapters/pirate/activate", json={"version": 1})
        assert r.status_code == 200 and r.json()["active_version"] == 1 and r.json()["warning"] is None, r.text
        assert listed("pirate")["version"] == 1


def _token_id(token: str) -> str:
    from control_plane.auth import token_id

    return token_id(token)
