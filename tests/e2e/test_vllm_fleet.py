"""The whole fleet against a real vLLM: the control plane, one `loraplane engine` and one vLLM server with
`loraplane agent` beside it, both behind `loraplane router`, every one a process of its own over loopback.

An upload with replicas {min 2} is placed on both engines, and both serve it through the router (the
official openai client): loraplane's greedy tokens are transformers + PEFT's exactly (float32), vLLM's by
the top-5 closeness rule. Activating another version switches vLLM in place, and the router's answers
from both engines are the new version's. A tenant key's streams from vLLM through the router are metered
by vLLM's own usage (`stream_options`): the router's metrics and the tokens its quota charged in Redis are
vLLM's counts. An unload leaves both engines. vLLM killed (its whole process group): the agent reports
the engine unhealthy, and an adapter of replicas {min 1, max 1} that only vLLM held is loaded on the
loraplane engine within the bound docs/vllm.md states, then served there through the router. The agent
killed: the engine goes stale at the control plane.

Without the vLLM venv these tests skip, unless CI is set (then they fail): `make test` creates it. The
stream's metering needs Redis at 127.0.0.1:6379, as tests/e2e/test_tenants.py does (skipped without).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import redis

from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine, scrape_metric
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    control_plane,
    engine_auth,
    engine_token,
    signal_group,
    started,
    wait_for,
)
from tests.e2e.test_control_plane_engines import _free_port as free_port
from tests.e2e.test_router import CLIENT_KEY, events, holders
from tests.e2e.test_tenants import (
    ENGINE_API_KEY,
    REDIS_URL,
    ROUTER_TOKEN,
    Fleet,
    charged,
    redis_ok,
    router_process,
)
from tests.e2e.test_vllm_agent import (
    ENGINE,
    NEW_TOKENS,
    SERVED,
    TOP,
    agent_command,
    agent_env,
    completion_greedy,
    engine_state,
    greedy_of,
    peft_greedy,
    upload,
    vllm_python,
    vllm_roots,
    vllm_server,
    write_model,
)

openai = pytest.importorskip("openai")

LORAPLANE = "e1"  # the loraplane engine's name (ENGINE, e3, is the agent's)
PROMPT = [5, 17, 42, 99, 200, 7, 311, 64]
RECONCILE_S, STALE_S, ENGINE_TIMEOUT_S = 1.0, 3.0, 5.0  # the control plane's; its test default engine timeout
WATCH_S = 0.5  # the agent's --watch-interval-s (agent_command)
# docs/vllm.md: an adapter held only by a vLLM that died is loaded elsewhere within the agent's watch
# interval, two reconcile intervals and the load itself (at most the control plane's engine timeout)
BOUND_S = WATCH_S + 2 * RECONCILE_S + ENGINE_TIMEOUT_S
TWO = '{"min": 2}'  # pirate's replicas: an upload sets them again
BURST, BURSTS = 12, 5  # concurrent requests per burst: over the router's affinity slack (8) plus one


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_fleet")
    models = tmp / "models"
    base, adapters = write_model(models)
    prefix = f"lptest:{uuid.uuid4().hex[:8]}:"
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    with contextlib.ExitStack() as stack:
        # no rebalancing: the adapter placed on vLLM alone stays there until vLLM dies
        cp = stack.enter_context(control_plane(
            tmp, models, flags=("--artifact-store", (tmp / "store").as_uri()), LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN,
            LORAPLANE_REDIS_URL=REDIS_URL, LORAPLANE_REDIS_PREFIX=prefix, LORAPLANE_RECONCILE_INTERVAL_S=str(RECONCILE_S),
            LORAPLANE_ENGINE_STALE_AFTER_S=str(STALE_S), LORAPLANE_ENGINE_TIMEOUT_S=str(ENGINE_TIMEOUT_S),
            LORAPLANE_REBALANCE_MAX_MOVES="0"))
        empty = tmp / "empty-root"
        empty.mkdir()
        flags = ("--enable-lora", "--lora-roots", str(empty), "--lora-cache-dir", str(tmp / "cache-e1"), "--admin-token",
                 engine_token(LORAPLANE), "--control-plane", cp, "--engine-name", LORAPLANE, "--served-model-name",
                 SERVED, "--dtype", "float32", "--max-lora-rank", "8", "--heartbeat-interval-s", "0.5", *SHARED_FLAGS)
        env = {"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS[LORAPLANE], "LORAPLANE_API_KEY": ENGINE_API_KEY}
        with ThreadPoolExecutor(2) as pool:  # each start takes seconds; vLLM's tens
            starting_vllm = pool.submit(stack.enter_context, vllm_server(python, base, tmp / "vllm.log"))
            starting_engine = pool.submit(stack.enter_context, run_engine(base, tmp / "e1.log", *flags, env=env))
            references = {name: peft_greedy(base, adapters[name], PROMPT) for name in ("v1", "v2", "other")}
            vllm, engine = starting_vllm.result(), starting_engine.result()
        port = free_port()
        agent = f"http://127.0.0.1:{port}"
        agent_process = stack.enter_context(started(
            agent_command(vllm.url, cp, tmp / "adapters", port), tmp / "agent.log", agent_env(),
            lambda: httpx.get(agent + "/health", timeout=2).status_code == 200, "the agent"))
        reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        wait_for(lambda: {e["name"]: e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]}
                 == {LORAPLANE: "healthy", ENGINE: "healthy"}, "both engines to register")
        router, _ = stack.enter_context(router_process(cp, prefix, tmp / "router.log", engines=2,
                                                       LORAPLANE_API_KEYS=CLIENT_KEY))
        yield SimpleNamespace(
            cp=cp, vllm=vllm, engine=engine, agent=agent, agent_process=agent_process, adapters=adapters,
            adapter_dir=tmp / "adapters", admin=admin, reader=reader, router=router, references=references,
            client=openai.OpenAI(base_url=router + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60),
            tenancy=Fleet(cp, engine.url, prefix, admin, [], {}, []))
    if redis_ok():
        client = redis.Redis.from_url(REDIS_URL)
        leftover = list(client.scan_iter(prefix + "*"))
        if leftover:
            client.delete(*leftover)


def routed(fleet: SimpleNamespace, model: str):  # noqa: ANN201
    """One greedy completion through the router with the official client: (the engine that answered, its
    continuation)."""
    raw = fleet.client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=TOP, extra_body={"ignore_eos": True})
    logprobs = raw.parse().choices[0].logprobs
    return raw.headers["x-loraplane-engine"], greedy_of(logprobs.tokens, logprobs.top_logprobs)


def assert_both_serve(fleet: SimpleNamespace, model: str, version: str) -> None:
    """Each engine serves `model` as PEFT's `version` (loraplane's exactly, vLLM's by the closeness rule),
    asked directly; and so does every answer through the router, from bursts of concurrent requests until
    both engines have answered some (the router keeps an adapter on the engine that last served it until
    that one has its affinity slack more requests in flight, which a busy host may never reach: the
    engine the router did not pick has then answered directly only)."""
    from tests.data_plane.bfloat16.closeness import assert_close

    answers: dict[str, list] = {
        LORAPLANE: [completion_greedy(fleet.engine.url, model, PROMPT, {"Authorization": f"Bearer {ENGINE_API_KEY}"})],
        ENGINE: [completion_greedy(fleet.vllm.url, model, PROMPT)]}
    routed_by: set[str] = set()
    for _ in range(BURSTS):
        with ThreadPoolExecutor(BURST) as pool:
            for engine, greedy in pool.map(lambda _: routed(fleet, model), range(BURST)):
                answers[engine].append(greedy)
                routed_by.add(engine)
        if routed_by == {LORAPLANE, ENGINE}:
            break
    assert routed_by, "the router answered nothing"
    reference = fleet.references[version]
    assert all(g.tokens == reference.tokens for g in answers[LORAPLANE]), (answers[LORAPLANE], reference)
    results = assert_close(answers[ENGINE], [reference] * len(answers[ENGINE]), [ENGINE] * len(answers[ENGINE]))
    assert all(r.agreed >= 4 for r in results), results  # the adapter's tokens, not a near-tie from the start


def loraplane_holds(fleet: SimpleNamespace) -> set[str]:
    listed = httpx.get(fleet.engine.api + "/lora_adapters", headers=engine_auth(LORAPLANE), timeout=10).json()
    return {a["name"] for a in listed["adapters"] if a["state"] == "ready"}


def test_an_upload_of_two_replicas_is_placed_on_both_engines(fleet: SimpleNamespace) -> None:
    digest = upload(fleet, "pirate", fleet.adapters["v1"], replicas=TWO, loaded_on=(LORAPLANE, ENGINE))["sha256"]
    assert vllm_roots(fleet)["pirate"] == str(fleet.adapter_dir / digest)
    assert "pirate" in loraplane_holds(fleet)
    # and one held by vLLM alone, for when vLLM dies
    r = fleet.admin.post(fleet.cp + "/v1/load_lora_adapter", json={
        "lora_name": "solo", "lora_path": str(fleet.adapters["other"]), "base_model": SERVED, "engines": [ENGINE],
        "replicas": {"min": 1, "max": 1}})
    assert r.status_code == 200 and [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [(ENGINE, "loaded")], \
        r.text
    wait_for(lambda: holders(fleet.cp, "pirate") == {LORAPLANE, ENGINE} and holders(fleet.cp, "solo") == {ENGINE},
             "the routing table to list the holders")


def test_both_engines_serve_it_as_peft_does(fleet: SimpleNamespace) -> None:
    from tests.data_plane.bfloat16.closeness import assert_close

    reference = fleet.references["v1"]
    direct = completion_greedy(fleet.engine.url, "pirate", PROMPT, {"Authorization": f"Bearer {ENGINE_API_KEY}"})
    assert direct.tokens == reference.tokens  # float32: exactly
    assert_close([completion_greedy(fleet.vllm.url, "pirate", PROMPT)], [reference], [ENGINE])
    assert_both_serve(fleet, "pirate", "v1")


def test_activating_another_version_switches_vllm_in_place(fleet: SimpleNamespace) -> None:
    before = vllm_roots(fleet)["pirate"]
    version = upload(fleet, "pirate", fleet.adapters["v2"], replicas=TWO, loaded_on=(), activate=False)
    assert vllm_roots(fleet)["pirate"] == before  # recorded, not placed
    r = fleet.admin.post(fleet.cp + "/v1/lora_adapters/pirate/activate", json={"version": version["version"]})
    assert r.status_code == 200, r.text
    assert sorted((e["engine"], e["outcome"]) for e in r.json()["engines"]) == [(LORAPLANE, "loaded"), (ENGINE, "loaded")]
    assert vllm_roots(fleet)["pirate"] == str(fleet.adapter_dir / version["sha256"]) != before
    assert_both_serve(fleet, "pirate", "v2")


def test_a_stream_from_vllm_through_the_router_is_metered_by_vllms_usage(fleet: SimpleNamespace) -> None:
    if not redis_ok():
        pytest.skip("no Redis at 127.0.0.1:6379: the router's token quotas are counted there")
    key = fleet.tenancy.make_tenant("team-v", tokens_per_minute=10**6)
    r = fleet.admin.put(f"{fleet.cp}/v1/tenancy/adapters/solo", json={"owner": "team-v", "public": False})
    assert r.status_code == 200, r.text
    auth = {"Authorization": f"Bearer {key}"}
    wait_for(lambda: "solo" in [m["id"] for m in httpx.get(fleet.router + "/v1/models", headers=auth, timeout=10)
                                .json()["data"]], "the router to let the tenant use solo")
    prompt = " ".join(f"t{i}" for i in PROMPT * 5)  # text, which admission estimates (bytes / 4)
    exact = httpx.post(fleet.vllm.url + "/v1/completions", timeout=60, json={
        "model": "solo", "prompt": prompt, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert exact != len(json.dumps(prompt)) // 4 + 1  # the estimate is off: only vLLM's count can be right
    body = {"model": "solo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    # a stream that asked for no usage: the router asks vLLM for it, meters it and takes it out again
    with httpx.stream("POST", fleet.router + "/v1/completions", json=body, headers=auth, timeout=60) as response:
        assert response.status_code == 200 and response.headers["x-loraplane-engine"] == ENGINE
        chunks = events(response.read().decode())
    assert chunks and all(c.get("usage") is None and c["choices"] for c in chunks), json.dumps(chunks)
    # a client asking for continuous usage gets vLLM's in every chunk
    client = openai.OpenAI(base_url=fleet.router + "/v1", api_key=key, max_retries=0, timeout=60)
    every = list(client.completions.create(model="solo", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}, stream_options={
                                               "include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in every) and every[-1].usage.completion_tokens == 6
    assert every[-1].usage.prompt_tokens == exact
    wait_for(lambda: charged(fleet.tenancy, "team-v") == 2 * (exact + 6), "the quota to be charged vLLM's count")
    assert scrape_metric(fleet.router, "loraplane_router_tenant_tokens_total", 'kind="prompt",tenant="team-v"') == 2 * exact
    assert scrape_metric(fleet.router, "loraplane_router_tenant_tokens_total", 'kind="completion",tenant="team-v"') == 12


def test_an_unload_leaves_both_engines(fleet: SimpleNamespace) -> None:
    r = fleet.admin.post(fleet.cp + "/v1/unload_lora_adapter", json={"lora_name": "pirate"})
    assert r.status_code == 200, r.text
    assert sorted((e["engine"], e["outcome"]) for e in r.json()["engines"]) == [
        (LORAPLANE, "unloaded"), (ENGINE, "unloaded")]
    assert "pirate" not in vllm_roots(fleet) and "pirate" not in loraplane_holds(fleet)

    def gone() -> bool:
        with contextlib.suppress(openai.NotFoundError):
            fleet.client.completions.create(model="pirate", prompt=PROMPT, max_tokens=1)
            return False
        return True

    wait_for(gone, "the router to answer 404 for pirate")


def test_vllm_killed_its_adapter_is_loaded_on_the_loraplane_engine_within_the_bound(fleet: SimpleNamespace) -> None:
    assert holders(fleet.cp, "solo") == {ENGINE} and "solo" not in loraplane_holds(fleet)
    killed = time.monotonic()
    signal_group(fleet.vllm.process, signal.SIGKILL)  # the server and its engine-core process
    fleet.vllm.process.wait()
    wait_for(lambda: engine_state(fleet.reader, fleet.cp) == "unhealthy", "the agent to report vLLM down")
    r = httpx.get(fleet.agent + "/health", timeout=10)
    assert r.status_code == 503 and "vLLM" in r.text, r.text
    wait_for(lambda: "solo" in loraplane_holds(fleet), "solo to be loaded on the loraplane engine", timeout_s=60)
    elapsed = time.monotonic() - killed
    assert elapsed <= BOUND_S, f"solo was loaded elsewhere {elapsed:.1f} s after vLLM died; the bound is {BOUND_S} s"

    def served_by_loraplane() -> bool:
        with contextlib.suppress(openai.APIError):
            engine, greedy = routed(fleet, "solo")
            assert greedy.tokens == fleet.references["other"].tokens
            return engine == LORAPLANE
        return False

    wait_for(served_by_loraplane, "the router to send solo to the loraplane engine")


def test_the_agent_killed_makes_the_engine_stale(fleet: SimpleNamespace) -> None:
    signal_group(fleet.agent_process, signal.SIGKILL)
    fleet.agent_process.wait()
    wait_for(lambda: engine_state(fleet.reader, fleet.cp) == "stale", "the control plane to see the agent gone")
    assert {e["name"]: e["state"] for e in fleet.reader.get(fleet.cp + "/v1/engines").json()["data"]}[LORAPLANE] \
        == "healthy"
