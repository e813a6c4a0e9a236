"""End to end over loopback: an engine registered with kind `vllm`, as `loraplane agent` registers a vLLM
server, gets its inference through the router at its inference URL, never at its admin URL.

Two real `loraplane engine` processes stand in for the two sides of such an engine: `admin` plays the
agent (its `url`: the control plane pushes loads there, and it holds what is placed), `serving` plays vLLM
(its `inference_url`; the test loads the adapter into it directly, as the agent does into vLLM). Base and
adapter completions, a stream and a chat through the router are answered as `serving` answers them
directly, named after the registered engine; `serving`'s request counters count them and `admin`'s count
none.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine, scrape_metric
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    _free_port,
    control_plane,
    engine_token,
    started,
)
from tests.e2e.test_router import CLIENT_KEY, ENGINE_KEY, PROMPT, ROUTER_TOKEN, events, holders, wait_for

openai = pytest.importorskip("openai")

NAME = "e1"  # registered with its own engine credential, as the agent registers: the router sends it the key


def finished(engine_url: str) -> float:
    """The requests `engine_url` has finished, every adapter and outcome."""
    return scrape_metric(engine_url, "loraplane_requests_total")


def test_inference_goes_to_the_inference_url_and_never_to_the_admin_url(tmp_path: Path) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    paths = write_demo_adapters(base, root)
    key = {"Authorization": f"Bearer {CLIENT_KEY}"}
    engine_key = {"Authorization": f"Bearer {ENGINE_KEY}"}
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp_path, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN))
        control = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
        flags = ("--enable-lora", "--lora-roots", str(root), *SHARED_FLAGS)
        env = {"LORAPLANE_API_KEY": ENGINE_KEY}  # both would serve the router: only the counters tell them apart
        # `admin` fetches what is placed from the control plane and heartbeats as the agent does; it registers
        # itself once at start (again only if the control plane forgets it), as a loraplane engine ...
        admin = stack.enter_context(run_engine(
            base, tmp_path / "admin.log", *flags, "--admin-token", engine_token(NAME), "--control-plane", cp,
            "--engine-name", NAME, env={**env, "LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS[NAME]}))
        wait_for(lambda: [e["name"] for e in control.get("/v1/engines").json()["data"]] == [NAME], "the registration")
        serving_token = engine_token("serving")
        serving = stack.enter_context(run_engine(base, tmp_path / "serving.log", *flags, "--admin-token",
                                                 serving_token, env=env))
        # ... and is registered again, with its credential, as the agent registers a vLLM server
        r = httpx.post(cp + "/v1/engines/register", timeout=30, headers={"Authorization": f"Bearer {CP_TOKENS[NAME]}"},
                       json={"name": NAME, "kind": "vllm", "url": admin.url, "inference_url": serving.url + "/",
                             "base_model": "demo", "slots_total": 4})
        assert r.status_code == 200, r.text
        assert (r.json()["kind"], r.json()["url"], r.json()["inference_url"]) == ("vllm", admin.url, serving.url)
        r = control.post("/v1/load_lora_adapter", json={"lora_name": "demo-poet", "lora_path": str(paths["demo-poet"]),
                                                         "base_model": "demo", "replicas": {"min": 1, "max": 1}})
        assert r.status_code == 200 and [e["outcome"] for e in r.json()["engines"]] == ["loaded"], r.text
        loaded = [a["name"] for a in httpx.get(admin.url + "/v1/lora_adapters", timeout=10,
                                               headers={"Authorization": f"Bearer {engine_token(NAME)}"}).json()["adapters"]]
        assert loaded == ["demo-poet"]  # the control plane's push went to the admin URL
        r = httpx.post(serving.url + "/v1/load_lora_adapter", timeout=60, headers={
            "Authorization": f"Bearer {serving_token}"}, json={"lora_name": "demo-poet", "lora_path": str(paths["demo-poet"])})
        assert r.status_code == 200, r.text
        wait_for(lambda: holders(cp, "demo-poet") == {NAME}, "demo-poet held by the engine")

        port = _free_port()
        router = f"http://127.0.0.1:{port}"
        router_env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
                      "PYTHONUNBUFFERED": "1", "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN,
                      "LORAPLANE_ENGINE_API_KEY": ENGINE_KEY, "LORAPLANE_API_KEYS": CLIENT_KEY}
        stack.enter_context(started([sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port",
                                     str(port)], tmp_path / "router.log", router_env,
                                    lambda: httpx.get(router + "/health", timeout=2).json()["routing_table"]["engines"]
                                    == 1, "router"))
        table = httpx.get(cp + "/v1/routes", headers={"Authorization": f"Bearer {READ}"}, timeout=10).json()
        assert [(e["url"], e["inference_url"]) for e in table["engines"]] == [(admin.url, serving.url)]

        # what `serving` answers directly, before the counters are read
        direct = {model: httpx.post(serving.url + "/v1/completions", json={"model": model, **PROMPT},
                                    headers=engine_key, timeout=60).json()["choices"][0]["text"]
                  for model in ("demo", "demo-poet")}
        stream = {"model": "demo-poet", **PROMPT, "stream": True}
        direct_stream = httpx.post(serving.url + "/v1/completions", json=stream, headers=engine_key, timeout=60).text
        before = {"admin": finished(admin.url), "serving": finished(serving.url)}

        for model, text in direct.items():
            r = httpx.post(router + "/v1/completions", json={"model": model, **PROMPT}, headers=key, timeout=60)
            assert r.status_code == 200 and r.headers["x-loraplane-engine"] == NAME, r.text
            assert r.json()["choices"][0]["text"] == text
        via = httpx.post(router + "/v1/completions", json=stream, headers=key, timeout=60)
        assert events(via.text) == events(direct_stream) and len(events(via.text)) > 2
        client = openai.OpenAI(base_url=router + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="demo-poet", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content is not None

        after = {"admin": finished(admin.url), "serving": finished(serving.url)}
        assert {k: after[k] - before[k] for k in after} == {"admin": 0, "serving": len(direct) + 2}
