"""A SIMULATOR of many engines in one light process, for bench/fleet_scale.py only.

Real engines do not fit on one small machine in the hundreds, so the scale benchmark points the real
control plane at this: N engine admin endpoints, each on its own loopback port, answering the calls the
control plane makes (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, `GET
/v1/lora_adapters`, `GET /v1/lora_stats`, `GET /health`) with the engines' own wire shapes
(shared.engine_admin), remembering per engine which adapter versions it "holds". It registers every
engine with the control plane (with the admin token, which may register any name, instead of 200
engine credentials) and sends each engine's heartbeat on its own timer. It loads no model, fetches no
artifact (a load is recorded at once) and serves no inference. It is never used by tests in place of
an engine: the tests run real engines.

    python bench/engine_sim.py --control-plane URL [--engines 200] [--heartbeat-s 5] [--host-slots 1024]
        (the control plane's admin token in LORAPLANE_ADMIN_TOKEN; the secret the engines' admin tokens
         derive from in LORAPLANE_ENGINE_ADMIN_TOKEN: each simulated engine checks its own token on every
         admin call as a real engine would)

It prints `{"registered": N}` once every engine is registered, then answers commands on stdin (see
`control`) with one JSON line each.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import uvicorn
from stack import engine_admin_token  # bench/stack.py: run as `python bench/engine_sim.py`

from shared.engine_admin import (
    AdapterList,
    AdapterListing,
    EngineHeartbeat,
    EngineRegistration,
    LoadedAdapter,
    LoraStats,
    RequestFigures,
    SlotUsage,
    UnloadedAdapter,
)

BASE_MODEL = "sim-base"
SIM_RANK = 8  # what a simulated engine says it loaded (no files are read)


@dataclass
class SimEngine:
    name: str
    port: int
    slots: int
    held: dict[str, tuple[str, int]] = field(default_factory=dict)  # adapter -> (sha256, version)
    next_id: int = 1
    alive: bool = True  # false: every call is refused (the benchmark's "engine left")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _json(status: int, body: Any) -> tuple[int, bytes]:
    return status, msgspec.json.encode(body)


class Simulator:
    def __init__(self, engines: list[SimEngine], token_secret: str | None) -> None:
        self.by_port = {e.port: e for e in engines}
        # each engine's own admin token, as the control plane derives it
        self.admin_tokens = {e.port: engine_admin_token(token_secret, e.name) for e in engines} if token_secret else {}
        self.calls = 0  # admin calls answered
        self.beats = 0  # heartbeats the control plane accepted
        self.beat_failures = 0
        self.beat_seconds: list[float] = []  # since the last `stats`

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        engine = self.by_port[scope["server"][1]]
        status, payload = self.handle(engine, scope["method"], scope["path"], dict(scope["headers"]), body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})

    def handle(self, e: SimEngine, method: str, path: str, headers: dict[bytes, bytes],
               body: bytes) -> tuple[int, bytes]:
        self.calls += 1
        if not e.alive:
            return _json(503, {"error": {"message": "simulated engine is down", "type": "overloaded"}})
        if path == "/health":
            return _json(200, {"status": "ok"})
        offered = headers.get(b"authorization", b"").decode().removeprefix("Bearer ")
        if self.admin_tokens and not hmac.compare_digest(offered, self.admin_tokens[e.port]):
            return _json(401, {"error": {"message": "admin token required", "type": "authentication_error"}})
        if method == "POST" and path == "/v1/load_lora_adapter":
            req = json.loads(body)
            name = req["lora_name"]
            sha = (req.get("artifact") or {}).get("digest") or req.get("expected_sha256") or "0" * 64
            version = e.held[name][1] + (e.held[name][0] != sha) if name in e.held else 1
            e.held[name] = (sha, version)
            e.next_id += 1
            return _json(200, LoadedAdapter(name=name, id=e.next_id, version=version, sha256=sha, rank=SIM_RANK,
                                            alpha=2.0 * SIM_RANK, target_modules=["q_proj"], size_bytes=0,
                                            residency="host"))
        if method == "POST" and path == "/v1/unload_lora_adapter":
            name = json.loads(body)["lora_name"]
            if e.held.pop(name, None) is None:
                return _json(404, {"error": {"message": f"adapter {name} is not loaded", "type": "not_found"}})
            return _json(200, UnloadedAdapter(name=name))
        if method == "GET" and path == "/v1/lora_adapters":
            rows = [AdapterListing(name=n, state="ready", id=i, version=v, sha256=sha, residency="host")
                    for i, (n, (sha, v)) in enumerate(e.held.items(), 1)]
            return _json(200, AdapterList(adapters=rows, slots=SlotUsage(used=0, total=e.slots)))
        if method == "GET" and path == "/v1/lora_stats":
            return _json(200, LoraStats(base=RequestFigures(name=BASE_MODEL, id=0), adapters=[]))
        return _json(404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})


async def register(http: httpx.AsyncClient, e: SimEngine, host_slots: int) -> None:
    reg = EngineRegistration(name=e.name, url=e.url, base_model=BASE_MODEL, slots_total=e.slots,
                             max_cpu_loras=host_slots)
    r = await http.post("/v1/engines/register", content=msgspec.json.encode(reg),
                        headers={"content-type": "application/json"})
    r.raise_for_status()


async def beat_forever(sim: Simulator, http: httpx.AsyncClient, e: SimEngine, interval_s: float, offset_s: float) -> None:
    """One engine's heartbeats, every `interval_s` from `offset_s` on: each engine beats on its own timer, as
    real engines do, so one slow answer of the control plane delays that engine's beat only."""
    await asyncio.sleep(offset_s)
    beat = msgspec.json.encode(EngineHeartbeat(slots_used=0, slots_total=e.slots))
    next_at = time.monotonic()
    while True:
        if e.alive:
            started = time.perf_counter()
            try:
                r = await http.post(f"/v1/engines/{e.name}/heartbeat", content=beat,
                                    headers={"content-type": "application/json"})
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            sim.beats += ok
            sim.beat_failures += not ok
            sim.beat_seconds.append(time.perf_counter() - started)
        next_at = max(next_at + interval_s, time.monotonic())  # a late beat is not made up for by a burst
        await asyncio.sleep(next_at - time.monotonic())


async def control(sim: Simulator, engines: list[SimEngine], http: httpx.AsyncClient, host_slots: int) -> None:
    """Commands on stdin, one per line, each answered by one JSON line on stdout (`stats`):
    `down N` (the first N engines stop answering and beating: they left), `up` (those that were down
    restart: they hold nothing, register again and beat), `stats` (counters only). The answer carries how
    many versions each engine holds, the admin calls served and the heartbeats sent (and their latency)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        cmd, *args = line.split()
        if cmd == "down":
            for e in engines[:int(args[0])]:
                e.alive = False
        elif cmd == "up":
            for e in engines:
                if not e.alive:
                    e.held.clear()  # a restarted engine holds nothing
                    e.alive = True
                    await register(http, e, host_slots)
        seconds = sorted(sim.beat_seconds)
        sim.beat_seconds.clear()
        print(json.dumps({"held": {e.name: len(e.held) for e in engines}, "calls": sim.calls, "beats": sim.beats,
                          "beat_failures": sim.beat_failures,
                          "beat_ms_p50": round(1e3 * seconds[len(seconds) // 2], 2) if seconds else None,
                          "beat_ms_max": round(1e3 * seconds[-1], 2) if seconds else None}), flush=True)


async def main_async(args: argparse.Namespace) -> None:
    sockets = []
    for _ in range(args.engines):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1024)
        sockets.append(s)
    engines = [SimEngine(name=f"sim-{i:03d}", port=s.getsockname()[1], slots=args.slots)
               for i, s in enumerate(sockets)]
    sim = Simulator(engines, os.environ.get("LORAPLANE_ENGINE_ADMIN_TOKEN"))
    server = uvicorn.Server(uvicorn.Config(sim, log_level="warning", lifespan="off", access_log=False))
    serving = asyncio.create_task(server.serve(sockets=sockets))
    token = os.environ["LORAPLANE_ADMIN_TOKEN"]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.control_plane, headers={"Authorization": f"Bearer {token}"},
                                 timeout=60, limits=limits) as http:
        for e in engines:
            await register(http, e, args.host_slots)
        print(json.dumps({"registered": len(engines)}), flush=True)
        beats = [asyncio.create_task(beat_forever(sim, http, e, args.heartbeat_s, i * args.heartbeat_s / len(engines)))
                 for i, e in enumerate(engines)]
        await control(sim, engines, http, args.host_slots)
        for task in beats:
            task.cancel()
    server.should_exit = True
    await serving


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control-plane", required=True)
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--slots", type=int, default=8, help="device slots each engine registers (--max-loras)")
    parser.add_argument("--host-slots", type=int, default=1024,
                        help="host-cache slots each engine registers (--max-cpu-loras): what placement counts as room")
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

