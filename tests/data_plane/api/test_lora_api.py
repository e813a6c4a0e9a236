"""Multi-LoRA over HTTP against a real `loraplane engine --enable-lora` on the demo model (CPU).

The module's engine preloads demo-pirate (rank 8) with --max-lora-rank 8, so demo-poet (rank 16)
serves as the "rank too high" refusal; demo-short (rank 4) is loaded under several names.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from data_plane.demo.adapters import write_demo_adapters
from tests.data_plane.api.conftest import SERVED_NAME, EngineServer, run_engine
from tests.data_plane.peft_adapters import edit_config

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "The old lighthouse keeper looked out over the grey water and said that the storm"
TOKEN = "tok-3f9a1c-admin"


@pytest.fixture(scope="module")
def lora_dirs(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """root: the engine's --lora-roots (the demo adapters plus broken variants); outside: not a root."""
    base = tmp_path_factory.mktemp("lora_api")
    root, outside = base / "root", base / "outside"
    demo = write_demo_adapters(demo_model_dir, root)
    short = demo["demo-short"]
    bin_only = shutil.copytree(short, root / "bin-only")
    torch.save(load_file(bin_only / "adapter_model.safetensors"), bin_only / "adapter_model.bin")
    (bin_only / "adapter_model.safetensors").unlink()
    corrupt = shutil.copytree(short, root / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    edit_config(shutil.copytree(short, root / "dora"), use_dora=True)
    shutil.copytree(short, outside / "demo-short")
    return {"root": root, "outside": outside, **demo}


@pytest.fixture(scope="module")
def lora_server(demo_model_dir: Path, lora_dirs, tmp_path_factory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("lora_logs") / "lora-engine.log"
    flags = ["--enable-lora", "--lora-roots", str(lora_dirs["root"]), "--max-loras", "2"]
    flags += ["--max-lora-rank", "8", "--max-model-len", "2048", "--num-kv-blocks", "256"]
    flags += ["--lora-modules", f"demo-pirate={lora_dirs['demo-pirate']}"]
    with run_engine(demo_model_dir, log, *flags) as server:
        yield server


@pytest.fixture
def http(lora_server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, timeout=120) as client:
        yield client


def load(http: httpx.Client, name: str, path: Path | str, **fields) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **fields})


def unload(http: httpx.Client, name: str, **fields) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name, **fields})


def complete(http: httpx.Client, model: str, prompt: str = PROMPT, max_tokens: int = 16) -> dict:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def text(http: httpx.Client, model: str) -> str:
    return complete(http, model)["choices"][0]["text"]


def adapters(http: httpx.Client) -> dict[str, dict]:
    return {a["name"]: a for a in http.get("/v1/lora_adapters").json()["adapters"]}


def test_openai_client_picks_adapters_by_model(lora_server, http, lora_dirs):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=lora_server.api, api_key="unused", max_retries=0, timeout=120)
    assert load(http, "demo-short", lora_dirs["demo-short"]).status_code == 200
    messages = [{"role": "user", "content": "Tell me about the sea."}]

    def answer(model: str) -> str:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert r.model == model
        return r.choices[0].message.content

    base, pirate, short = answer(SERVED_NAME), answer("demo-pirate"), answer("demo-short")
    assert len({base, pirate, short}) == 3  # each adapter changes the answer
    assert answer("demo-pirate") == pirate and answer(SERVED_NAME) == base  # and deterministically
    cards = {m.id: m for m in client.models.list().data}
    assert cards["demo-pirate"].model_extra["parent"] == SERVED_NAME
    assert cards["demo-pirate"].model_extra["root"] == str(lora_dirs["demo-pirate"].resolve())
    assert cards[SERVED_NAME].model_extra["parent"] is None
    with pytest.raises(openai.NotFoundError):
        answer("demo-nope")
    assert unload(http, "demo-short").status_code == 200


def test_load_list_stats_unload_and_reload(http, lora_dirs):
    r = load(http, "short-a", lora_dirs["demo-short"])
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["rank"] == 4 and info["load_generation"] == 1 and info["residency"] in ("host", "device")
    assert load(http, "short-a", lora_dirs["demo-short"]).json()["id"] == info["id"]  # idempotent
    before = text(http, "short-a")
    listed = adapters(http)["short-a"]
    assert listed["state"] == "ready" and listed["in_flight"] == 0 and listed["residency"] == "device"
    assert listed["sha256"] == info["sha256"] and listed["last_used_at"] is not None
    stats = {a["name"]: a for a in http.get("/v1/lora_stats").json()["adapters"]}["short-a"]
    assert stats["requests"]["ok"] == 1 and stats["generated_tokens"] == 16 and stats["loads"] >= 1
    assert stats["ttft_seconds"]["p50"] is not None and stats["load_seconds"]["last"] is not None
    assert unload(http, "short-a").json() == {"name": "short-a", "drained": True, "aborted": 0}
    assert "short-a" not in adapters(http)
    r = http.post("/v1/completions", json={"model": "short-a", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `short-a` does not exist."
    again = load(http, "short-a", lora_dirs["demo-short"]).json()
    assert again["id"] > info["id"] and again["sha256"] == info["sha256"]
    assert text(http, "short-a") == before  # reload gives the same output
    unload(http, "short-a")


def test_load_inplace_serves_the_new_content_without_stale_prefix_hits(http, lora_dirs, tmp_path):
    mutable = lora_dirs["root"] / "mutable"
    shutil.copytree(lora_dirs["demo-short"], mutable, dirs_exist_ok=True)
    assert load(http, "mut", mutable).status_code == 200
    first = complete(http, "mut")
    assert complete(http, "mut")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same adapter: hit
    shutil.copytree(lora_dirs["demo-pirate"], mutable, dirs_exist_ok=True)  # new content, same folder
    r = load(http, "mut", mutable)
    assert r.status_code == 409 and "load_inplace" in r.json()["error"]["message"]
    r = load(http, "mut", mutable, load_inplace=True)
    assert r.status_code == 200 and r.json()["load_generation"] == 2
    second = complete(http, "mut")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # new version: no old KV
    assert second["choices"][0]["text"] == text(http, "demo-pirate") != first["choices"][0]["text"]
    unload(http, "mut")


def test_adapters_do_not_share_prefix_cache_with_the_base(http):
    prompt = "A prompt nobody has sent before: " + PROMPT  # more than one full KV block

    def cached(model: str) -> int:
        return complete(http, model, prompt=prompt, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(SERVED_NAME) == 0 and cached(SERVED_NAME) > 0
    assert cached("demo-pirate") == 0  # the base's blocks are not the adapter's
    assert cached("demo-pirate") > 0


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("root/missing", "does not exist"),
        ("root/bin-only", "safetensors"),
        ("root/corrupt", "corrupt or truncated"),
        ("demo-poet", "--max-lora-rank"),
        ("outside/demo-short", "outside the allowed LoRA roots"),
        ("root/dora", "dora"),
    ],
)
def test_refused_adapters_are_4xx_and_the_engine_keeps_serving(http, lora_dirs, path, message):
    folder, _, rest = path.partition("/")
    target = lora_dirs[folder] / rest if rest else lora_dirs[folder]
    slots_before = http.get("/v1/lora_adapters").json()["slots"]
    r = load(http, "refused", target)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message.lower() in error["message"].lower()
    assert "refused" not in adapters(http)
    assert http.get("/v1/lora_adapters").json()["slots"] == slots_before
    assert complete(http, "demo-pirate", max_tokens=4)["usage"]["completion_tokens"] == 4


def stream_lines(http: httpx.Client, model: str, max_tokens: int, out: list[str], started: threading.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Go on."}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": max_tokens, **GREEDY}) as r:
        for line in r.iter_lines():
            if not line:  # the blank line that ends each event
                continue
            out.append(line)
            if len(out) >= 6:
                started.set()
    started.set()


def test_unload_waits_for_a_stream_in_flight(lora_server, http, lora_dirs):
    assert load(http, "drain-me", lora_dirs["demo-short"]).status_code == 200
    lines: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=stream_lines, args=(http, "drain-me", 600, lines, started))
    reader.start()
    assert started.wait(60)
    result: dict = {}
    unloader = threading.Thread(target=lambda: result.update(unload(http, "drain-me", drain_timeout_s=120).json()))
    unloader.start()
    time.sleep(0.3)
    assert unloader.is_alive()  # waits for the stream
    assert adapters(http)["drain-me"]["state"] == "draining"
    r = http.post("/v1/completions", json={"model": "drain-me", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["message"] == "adapter drain-me is being unloaded"
    reader.join(120)
    unloader.join(120)
    assert result == {"name": "drain-me", "drained": True, "aborted": 0}
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(lines)
    assert "drain-me" not in adapters(http)


def test_unload_aborts_a_stream_past_the_drain_timeout(lora_server, http, lora_dirs):
    assert load(http, "abort-me", lora_dirs["demo-short"]).status_code == 200
    aborts = lora_server.metric("loraplane_requests_total", 'outcome="abort"')
    lines: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=stream_lines, args=(http, "abort-me", 1900, lines, started))
    reader.start()
    assert started.wait(60)
    assert unload(http, "abort-me", drain_timeout_s=0.2).json() == {"name": "abort-me", "drained": False, "aborted": 1}
    reader.join(60)
    assert not reader.is_alive() and lines[-1] == "data: [DONE]"
    error_events = [line for line in lines if '"error"' in line]
    assert len(error_events) == 1 and "abort-me was unloaded" in error_events[0]
    assert lora_server.metric("loraplane_requests_total", 'outcome="abort"') == aborts + 1
    assert "abort-me" not in adapters(http)
    assert http.get("/v1/lora_adapters").json()["slots"]["used"] <= 1  # its slot was freed (pirate may hold one)


def test_lora_endpoints_are_400_without_enable_lora(engine_server):
    with httpx.Client(base_url=engine_server.url, timeout=30) as http:
        for r in (
            load(http, "x", "/tmp"),
            unload(http, "x"),
            http.get("/v1/lora_adapters"),
            http.get("/v1/lora_stats"),
        ):
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "LoRA is not enabled on this engine; start it with --enable-lora"


def test_admin_token_and_adapter_metrics_with_a_label_cap(start_engine, lora_dirs):
    read = "engine-read-token"
    server = start_engine(
        "--enable-lora", "--lora-roots", str(lora_dirs["root"]), "--admin-token", TOKEN, "--max-adapter-labels", "1",
        env={"LORAPLANE_READ_TOKEN": read},
    )
    with httpx.Client(base_url=server.url, timeout=60) as http:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"lora_name": "demo-pirate", "lora_path": str(lora_dirs["demo-pirate"])}
        for headers, status in [({}, 401), ({"Authorization": "Bearer nope"}, 403), ({"Authorization": TOKEN}, 401),
                                ({"Authorization": f"Bearer {read}"}, 403)]:  # the read token loads nothing
            assert http.post("/v1/load_lora_adapter", json=body, headers=headers).status_code == status
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=headers).status_code == status
        # the listings name every loaded adapter: not to anyone, with an admin token set
        for path in ("/v1/lora_adapters", "/v1/lora_stats", "/v1/models"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code in (401, 403), path
            assert http.get(path, headers=auth).status_code == 200, path
            assert http.get(path, headers={"Authorization": f"Bearer {read}"}).status_code == 200, path
        assert http.post("/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
        body = {"lora_name": "demo-short", "lora_path": str(lora_dirs["demo-short"])}
        assert http.post("/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
        for model in (SERVED_NAME, "demo-pirate", "demo-short", "not-served"):
            http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    ok = 'outcome="ok"'
    assert server.metric("loraplane_requests_total", f'adapter="{SERVED_NAME}",{ok}') == 1
    assert server.metric("loraplane_requests_total", f'adapter="demo-pirate",{ok}') == 1
    assert server.metric("loraplane_requests_total", f'adapter="other",{ok}') == 1  # past the cap
    assert server.metric("loraplane_requests_total", 'adapter="",outcome="rejected"') == 1  # unresolved
    assert server.metric("loraplane_generation_tokens_total", 'adapter="other"') == 2
    assert server.metric("loraplane_lora_slots_total") == 4 and server.metric("loraplane_lora_loads_total") >= 2
    assert server.metric("loraplane_lora_load_seconds_count", 'adapter="demo-pirate"') >= 1
    assert server.metric("loraplane_lora_running_sequences", 'adapter="demo-pirate"') == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'adapter="demo-short"' not in metrics and "not-served" not in metrics
    assert TOKEN not in server.log.read_text() and read not in server.log.read_text()


def test_concurrent_load_unload_storm_on_one_name_ends_consistent(lora_server, lora_dirs):
    """Loads (two contents, some in place), unloads and requests on one name at once, over real HTTP:
    afterwards the name is either cleanly loaded or absent, and no device slot is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    contents = [lora_dirs["demo-short"], lora_dirs["demo-pirate"]]

    def act(i: int) -> int:
        with httpx.Client(base_url=lora_server.url, timeout=120) as c:
            kind = i % 4
            if kind == 0:
                return load(c, "storm", contents[i % 2], load_inplace=True).status_code
            if kind == 1:
                return load(c, "storm", contents[0]).status_code
            if kind == 2:
                return unload(c, "storm", drain_timeout_s=1).status_code
            r = c.post("/v1/completions", json={"model": "storm", "prompt": "hi", "max_tokens": 4, **GREEDY})
            return r.status_code

    with ThreadPoolExecutor(max_workers=12) as pool:
        codes = list(pool.map(act, range(40)))
    assert set(codes) <= {200, 404, 409}, codes  # refusals are clean 4xx, never a 5xx
    with httpx.Client(base_url=lora_server.url, timeout=120) as c:
        listed = adapters(c)
        if "storm" in listed:
            assert listed["storm"]["state"] in ("ready", "draining")
            assert complete(c, "storm")["choices"][0]["text"]  # a loaded name serves
        unload(c, "storm")
        deadline = time.monotonic() + 30
        while "storm" in adapters(c) and time.monotonic() < deadline:  # older versions finish draining
            time.sleep(0.2)
        listed = adapters(c)
        assert "storm" not in listed
        slots = c.get("/v1/lora_adapters").json()["slots"]
        resident = sum(1 for a in listed.values() if a["residency"] == "device")
        assert slots["used"] == resident <= slots["total"]
        assert complete(c, "demo-pirate")["choices"][0]["text"]  # the engine still serves
