"""The router in front of a real engine: answers equal the engine's (JSON, and SSE chunk for chunk), the
openai client works unchanged, x-loraplane-engine names the engine, unknown models are 404 after one
placement call, a refused connection is retried on the next holder, client keys are checked and never
forwarded, bad bodies are 4xx, an engine that dies mid-stream ends the stream with an error event, and a
client that leaves aborts the engine's request. Structured outputs and a tool call pass through unchanged."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from shared.routes import RouteEngine
from tests.data_plane.api.conftest import EngineServer, run_engine, scrape_metric
from tests.data_plane.router.conftest import lora_flags
from tests.data_plane.router.support import (
    RouterUnderTest,
    RoutesServer,
    adapter_route,
    base_route,
    serve_router,
    serve_routes,
    wait_until,
)

openai = pytest.importorskip("openai")

ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")
DEAD = RouteEngine(name="dead", url="http://127.0.0.1:9", base_model="demo")  # nothing listens on port 9
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8, "temperature": 0}


def fleet(*servers: tuple[str, EngineServer]) -> RoutesServer:
    """A routes server listing `servers` (name, engine) as holders of demo and, on device, its adapters."""
    engines = [RouteEngine(name=n, url=s.url, base_model="demo") for n, s in servers]
    names = [n for n, _ in servers]
    models = [base_route("demo", *names), *(adapter_route(a, "demo", **dict.fromkeys(names, "device"))
                                            for a in ADAPTERS)]
    return RoutesServer(engines=engines, models=models)


@contextlib.contextmanager
def routed(routes: RoutesServer, **config: object) -> Iterator[RouterUnderTest]:
    with serve_routes(routes), serve_router(routes.url, refresh_interval_s=0.2, **config) as router:
        wait_until(lambda: router.service.table.loaded, "the routing table")
        yield router


def events(response: httpx.Response) -> list[dict]:
    """The SSE events of a streamed answer, less what differs between two requests (id, created)."""
    out = []
    for line in response.text.split("\n\n"):
        if line.startswith("data: {"):
            event = json.loads(line.removeprefix("data: "))
            event.pop("id", None)
            event.pop("created", None)
            out.append(event)
    assert response.text.endswith("data: [DONE]\n\n")
    return out


def stable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.fixture(scope="module")
def long_engine(demo_model_dir: Path, demo_adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    """An engine of the module for requests of 1,500 tokens that the tests abort or leave (never killed)."""
    log = tmp_path_factory.mktemp("long_engine") / "engine.log"
    with run_engine(demo_model_dir, log, *lora_flags(demo_adapters), "--num-kv-blocks", "256",
                    "--max-model-len", "2048") as server:
        yield server


@pytest.fixture(scope="module")
def router(lora_engine: EngineServer) -> Iterator[RouterUnderTest]:
    with routed(fleet(("e1", lora_engine))) as r:
        yield r


@pytest.mark.parametrize("model", ["demo", "demo-poet"])
@pytest.mark.parametrize(("path", "body"), [("/completions", COMPLETION), ("/chat/completions", CHAT)])
def test_answers_equal_the_engines(router: RouterUnderTest, lora_engine: EngineServer, model: str, path: str,
                                   body: dict) -> None:
    request = {"model": model, **body}
    direct = httpx.post(lora_engine.api + path, json=request, timeout=60)
    via = httpx.post(router.api + path, json=request, timeout=60)
    assert via.status_code == direct.status_code == 200, via.text
    assert via.headers["x-loraplane-engine"] == "e1"
    assert stable(via.json()) == stable(direct.json())

    streamed = {**request, "stream": True}
    direct = httpx.post(lora_engine.api + path, json=streamed, timeout=60)
    via = httpx.post(router.api + path, json=streamed, timeout=60)
    assert via.status_code == 200 and via.headers["content-type"].startswith("text/event-stream")
    assert via.headers["x-loraplane-engine"] == "e1"
    assert events(via) == events(direct) and len(events(via)) >= 2


def test_the_openai_client_works_unchanged(router: RouterUnderTest, lora_engine: EngineServer) -> None:
    client = openai.OpenAI(base_url=router.api, api_key="unused", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=lora_engine.api, api_key="unused", max_retries=0, timeout=60)
    kwargs = {"model": "demo-pirate", "messages": CHAT["messages"], "max_tokens": 8, "temperature": 0}
    assert (client.chat.completions.create(**kwargs).choices[0].message.content
            == direct.chat.completions.create(**kwargs).choices[0].message.content)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
              if c.choices]
    assert "".join(pieces) == direct.chat.completions.create(**kwargs).choices[0].message.content
    listed = {m.id: m.parent for m in client.models.list()}
    assert listed == {"demo": None, **dict.fromkeys(ADAPTERS, "demo")}
    assert client.models.retrieve("demo-poet").parent == "demo"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: Annotated[str, Field(pattern="^[a-z]{1,6}$")]


CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_structured_outputs_and_a_tool_call_on_an_adapter_pass_through(long_engine: EngineServer) -> None:
    """The grammar alone makes a random model's answers valid; through the router they equal the engine's.
    (The long engine: the tools' system prompt is longer than the module's other engine's context.)"""
    direct = openai.OpenAI(base_url=long_engine.api, api_key="unused", max_retries=0, timeout=60)
    chat = {"model": "demo-poet", "messages": CHAT["messages"], "max_tokens": 60, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_time"}}
    with routed(fleet(("e1", long_engine))) as router:
        client = openai.OpenAI(base_url=router.api, api_key="unused", max_retries=0, timeout=60)
        parsed = client.chat.completions.parse(response_format=Pet, **chat).choices[0]
        with client.chat.completions.stream(tools=[CLOCK], tool_choice=named, **chat) as stream:
            [call] = stream.get_final_completion().choices[0].message.tool_calls
    assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, Pet)
    assert parsed.message.parsed == direct.chat.completions.parse(response_format=Pet, **chat).choices[0].message.parsed
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    [same] = direct.chat.completions.create(tools=[CLOCK], tool_choice=named, **chat).choices[0].message.tool_calls
    assert same.function.arguments == call.function.arguments


def test_unknown_models_are_404_after_one_placement_call(router: RouterUnderTest) -> None:
    routes = router.service.placer
    before = routes.calls
    results: list[httpx.Response] = []

    def ask() -> None:
        results.append(httpx.post(router.api + "/completions", json={"model": "nobody/knows", **COMPLETION}))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [404] * 6
    body = results[0].json()["error"]
    assert (body["type"], body["param"], body["code"]) == ("not_found_error", "model", "model_not_found")
    assert "x-loraplane-engine" not in results[0].headers
    assert routes.calls - before <= 1  # concurrent waiters share the call; later ones hit the negative cache
    again = httpx.post(router.api + "/completions", json={"model": "nobody/knows", **COMPLETION})
    assert again.status_code == 404 and routes.calls - before == 1
    bad_name = httpx.post(router.api + "/completions", json={"model": "../etc", **COMPLETION})
    assert bad_name.status_code == 404 and routes.calls - before == 1  # never sent to the control plane


def test_an_unplaced_adapter_is_placed_once_for_all_waiters(lora_engine: EngineServer) -> None:
    routes = fleet(("e1", lora_engine))
    routes.models = [m for m in routes.models if m.model != "demo-short"]
    routes.placements["demo-short"] = adapter_route("demo-short", "demo", e1="loading")
    routes.place_delay_s = 0.5  # requests pile up behind the one placement
    with routed(routes) as router:
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(
            router.api + "/completions", json={"model": "demo-short", **COMPLETION}, timeout=60))) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200] * 5, [r.text for r in results]
        assert routes.place_calls == [["demo-short"]]
        assert len({r.json()["choices"][0]["text"] for r in results}) == 1
        assert scrape_metric(router.url, "loraplane_router_affinity_total", 'result="miss"') >= 1  # loading


@pytest.mark.parametrize("model", ["demo", "demo-poet"])
def test_a_refused_connection_is_retried_on_the_next_holder(lora_engine: EngineServer, model: str) -> None:
    routes = fleet(("e1", lora_engine))
    routes.engines.append(DEAD)
    # the dead engine is the better holder: device (the live one only host) for the adapter, and the only
    # base holder but for the live one listed after it
    routes.models = [base_route("demo", "dead", "e1"),
                     *(adapter_route(a, "demo", dead="device", e1="host") for a in ADAPTERS)]
    with routed(routes) as router:
        sent = 0
        # the adapter's device holder goes first every time; of the base model's two equal holders a random
        # one does (prompts differ: no prefix affinity): ask until the dead one was picked (probability 1/2)
        while sent < 40 and (sent < 3 or scrape_metric(router.url, "loraplane_router_retries_total") == 0):
            r = httpx.post(router.api + "/completions", timeout=60,
                           json={"model": model, **COMPLETION, "prompt": f"{sent} {COMPLETION['prompt']}"})
            assert r.status_code == 200 and r.headers["x-loraplane-engine"] == "e1", r.text
            sent += 1
        assert scrape_metric(router.url, "loraplane_router_retries_total", 'reason="connect"') >= 1
        assert scrape_metric(router.url, "loraplane_router_requests_total", 'engine="e1",outcome="ok"') == sent


def test_no_reachable_holder_is_503(lora_engine: EngineServer) -> None:
    routes = RoutesServer(engines=[DEAD], models=[base_route("demo", "dead")])
    with routed(routes) as router:
        r = httpx.post(router.api + "/completions", json={"model": "demo", **COMPLETION}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        assert scrape_metric(router.url, "loraplane_router_requests_total", 'outcome="unavailable"') == 1


def test_client_keys_are_required_and_never_forwarded(start_lora_engine) -> None:  # noqa: ANN001
    engine = start_lora_engine("--api-key", "engine-key-for-tests")
    with routed(fleet(("e1", engine)), api_keys=frozenset({"client-key"}),
                engine_api_key="engine-key-for-tests") as router:
        request = {"model": "demo", **COMPLETION}
        missing = httpx.post(router.api + "/completions", json=request)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(router.api + "/completions", json=request, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        assert httpx.get(router.api + "/models").status_code == 401
        assert scrape_metric(router.url, "loraplane_router_requests_total", 'outcome="rejected"') == 2
        ok = httpx.post(router.api + "/completions", json=request, headers={"Authorization": "Bearer client-key"},
                        timeout=60)
        assert ok.status_code == 200, ok.text  # the router sent the engine's key, not the client's
        assert httpx.post(engine.api + "/completions", json=request,
                          headers={"Authorization": "Bearer client-key"}).status_code == 401
        assert httpx.get(router.url + "/health").status_code == 200  # open, as /metrics


def test_bad_bodies_are_clear_4xx(router: RouterUnderTest) -> None:
    url = router.api + "/chat/completions"
    cases = [(b"{nope", 400, None), (b'{"messages": []}', 400, "model"), (b'{"model": "demo", "stream": 1}', 400,
                                                                          "stream")]
    for body, status, param in cases:
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    big = b'{"model": "demo", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert "exceeds the limit of 8388608 bytes" in r.json()["error"]["message"]
    chunked = (big[i:i + 1024 * 1024] for i in range(0, len(big), 1024 * 1024))  # no Content-Length: counted
    r = httpx.post(url, content=chunked, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    # the engine's own 400 passes through, with the engine named
    r = httpx.post(url, json={"model": "demo", "messages": "not a list"})
    assert r.status_code == 400 and r.headers["x-loraplane-engine"] == "e1"
    assert httpx.get(router.url + "/health").status_code == 200  # and the router lives on


def test_client_disconnect_aborts_the_engines_request(long_engine: EngineServer) -> None:
    engine = long_engine
    aborts = engine.metric("loraplane_requests_total", 'outcome="abort"')
    long = {"model": "demo-poet", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with routed(fleet(("e1", engine))) as router:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", router.api + "/completions", json={**long, "prompt": "Once", "stream": True}) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(6))
        wait_until(lambda: engine.metric("loraplane_requests_total", 'outcome="abort"') == aborts + 1, "a streamed abort")
        with pytest.raises(httpx.TimeoutException):
            httpx.post(router.api + "/completions", json={**long, "prompt": "Once"}, timeout=1.0)
        wait_until(lambda: engine.metric("loraplane_requests_total", 'outcome="abort"') == aborts + 2, "a whole abort")
        wait_until(lambda: router.service.balancer.outstanding.get("e1") == 0, "nothing outstanding")
        assert scrape_metric(router.url, "loraplane_router_requests_total", 'outcome="abort"') == 2


def test_an_engine_that_dies_mid_stream_ends_it_with_an_error_event(start_lora_engine) -> None:  # noqa: ANN001
    engine = start_lora_engine("--num-kv-blocks", "256", "--max-model-len", "2048")
    with routed(fleet(("e1", engine))) as router:
        with httpx.Client(timeout=60) as client, client.stream("POST", router.api + "/completions", json={
                "model": "demo-poet", "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data: {") for _ in range(6)) >= 2
            engine.process.kill()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "bad_gateway" and "e1" in error["message"]
        assert scrape_metric(router.url, "loraplane_router_requests_total", 'engine="e1",outcome="error"') == 1
        wait_until(lambda: router.service.balancer.outstanding.get("e1") == 0, "nothing outstanding")


def test_demand_is_reported_while_requests_run(long_engine: EngineServer) -> None:
    routes = fleet(("e1", long_engine))
    with routed(routes, demand_interval_s=0.1) as router:
        with httpx.Client(timeout=60) as client, client.stream("POST", router.api + "/completions", json={
                "model": "demo-poet", "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # held: a line iterator dropped at once closes the connection (an abort)
            next(lines)
            wait_until(lambda: any(d.model == "demo-poet" and d.running == 1 for rep in routes.demand
                                   for d in rep.demand), "a report of the running request")
        wait_until(lambda: any(d.model == "demo-poet" and d.running == 0 for d in routes.demand[-1].demand),
                   "the report of its end")
        assert all(d.model in ADAPTERS for rep in routes.demand for d in rep.demand)  # adapters only


def test_a_503_is_retried_on_the_next_holder(lora_engine: EngineServer, start_lora_engine) -> None:  # noqa: ANN001
    busy = start_lora_engine("--max-num-seqs", "1", "--max-waiting-requests", "1", "--num-kv-blocks", "256",
                             "--max-model-len", "2048")
    routes = fleet(("busy", busy), ("e1", lora_engine))
    routes.models = [adapter_route("demo-poet", "demo", busy="device", e1="host")]
    long = {"model": "demo-poet", "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    answers: list[int] = []
    done = threading.Event()

    def fill() -> None:
        # streamed and left once the check is done (an abort), so the busy engine never decodes 2 x 1500 tokens
        with httpx.stream("POST", busy.api + "/completions", json=long, timeout=120) as response:
            answers.append(response.status_code)
            done.wait(120)

    fillers = [threading.Thread(target=fill) for _ in range(2)]
    with routed(routes) as router:
        fillers[0].start()  # one running, then one waiting: the engine's queue is full
        wait_until(lambda: busy.metric("loraplane_running_sequences") == 1, "one running")
        fillers[1].start()
        wait_until(lambda: busy.metric("loraplane_waiting_sequences") == 1, "one waiting")
        assert httpx.post(busy.api + "/completions", json={**long, "stream": False}).status_code == 503
        r = httpx.post(router.api + "/completions", json={"model": "demo-poet", **COMPLETION}, timeout=60)
        assert r.status_code == 200 and r.headers["x-loraplane-engine"] == "e1", r.text
        assert scrape_metric(router.url, "loraplane_router_retries_total", 'reason="unavailable"') == 1
        done.set()
        for filler in fillers:
            filler.join()
        assert answers == [200, 200]  # the fillers themselves were admitted, not refused


def test_base_prompts_with_one_prefix_and_an_adapters_requests_stay_on_one_engine(
        lora_engine: EngineServer, start_lora_engine) -> None:  # noqa: ANN001
    other = start_lora_engine()
    with routed(fleet(("e1", lora_engine), ("e2", other))) as router:
        prompt = "A long shared system prompt that every request of this conversation starts with. " * 4
        served = {httpx.post(router.api + "/completions", timeout=60, json={
            "model": "demo", **COMPLETION, "prompt": prompt + f"question {i}"}).headers["x-loraplane-engine"]
            for i in range(6)}
        assert len(served) == 1
        assert scrape_metric(router.url, "loraplane_router_prefix_affinity_total", 'result="hit"') == 5
        # both engines have the adapter on device; its requests, whatever their prompts, go where the last
        # went (at random, six in a row on one engine would be 1 in 32)
        served = {httpx.post(router.api + "/completions", timeout=60, json={
            "model": "demo-poet", **COMPLETION, "prompt": f"{i} {COMPLETION['prompt']}"}).headers["x-loraplane-engine"]
            for i in range(6)}
        assert len(served) == 1


def test_pooled_engine_connections_are_dropped_before_the_engine_closes_them() -> None:
    """Engines serve with uvicorn, which closes a connection idle for 5 s (its default): the router must
    not reuse one idle that long, or a request sent as the engine closes it is lost to a reset."""
    import asyncio
    import socket

    import uvicorn

    from data_plane.router.proxy import ENGINE_KEEPALIVE_S, engine_session

    peers: list[int] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        peers.append(scope["client"][1])  # the router's port: one per connection
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    assert server.config.timeout_keep_alive > ENGINE_KEEPALIVE_S
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"

    async def requests() -> None:
        async with engine_session(connect_timeout_s=2, read_timeout_s=10, max_connections=8) as session:
            for pause in (0.0, 0.2, ENGINE_KEEPALIVE_S + 0.3):
                await asyncio.sleep(pause)
                async with session.get(url) as response:
                    assert await response.read() == b"ok"

    try:
        while not server.started:
            threading.Event().wait(0.02)
        asyncio.run(requests())
    finally:
        server.should_exit = True
        thread.join(10)
    assert peers[0] == peers[1] != peers[2]  # reused while fresh, not once idle past the bound
