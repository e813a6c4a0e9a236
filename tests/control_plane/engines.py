"""Real `loraplane engine --enable-lora` processes for the control-plane tests that push to engines, and
the control plane served over real HTTP for them (engines fetch adapter versions from it by digest)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import uvicorn
from litestar import Litestar

from control_plane.app import create_app
from control_plane.cli import GRACEFUL_SHUTDOWN_S
from control_plane.settings import ControlPlaneSettings
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine
from tests.e2e.test_control_plane_engines import engine_auth, engine_token

# each engine's own token at the control plane (its LORAPLANE_CONTROL_PLANE_TOKEN): it fetches artifacts
CP_TOKENS = {"ea": "cp-token-of-ea-for-tests", "eb": "cp-token-of-eb-for-tests", "ec": "cp-token-of-ec-for-tests"}


@contextlib.contextmanager
def lora_engine(base: Path, adapter_root: Path, log: Path, *flags: str, name: str,
                control_plane: str | None = None) -> Iterator[EngineServer]:
    """An engine serving the demo model as `demo`, with LoRA on and engine `name`'s admin token
    (`engine_token(name)`: the control plane calls it as `name`); with `control_plane`, it registers there as
    `name` and fetches artifacts from it."""
    env = {"LORAPLANE_ADMIN_TOKEN": engine_token(name)}
    if control_plane is not None:
        flags = (*flags, "--control-plane", control_plane, "--engine-name", name)
        env["LORAPLANE_CONTROL_PLANE_TOKEN"] = CP_TOKENS[name]
    with run_engine(base, log, "--enable-lora", "--lora-roots", str(adapter_root), *SHARED_FLAGS, *flags,
                    env=env) as server:
        yield server


@contextlib.contextmanager
def engine_pair(demo: dict[str, Path], logs: Path, control_plane: str) -> Iterator[list[EngineServer]]:
    """Engines `ea` and `eb` (`lora_engine`), registering at `control_plane` (heartbeats every second, so
    that a control plane started on a fresh database hears from them soon)."""
    beat = ("--heartbeat-interval-s", "1")
    with lora_engine(demo["base"], demo["root"], logs / "a.log", *beat, name="ea", control_plane=control_plane) as a, \
            lora_engine(demo["base"], demo["root"], logs / "b.log", *beat, name="eb", control_plane=control_plane) as b:
        yield [a, b]


async def register_pair(client: httpx.AsyncClient, engines: list[EngineServer], headers: dict[str, str]) -> None:
    """Wait until `engine_pair`'s engines have registered themselves at `client`'s control plane."""
    await registered_themselves(client, {"ea": engines[0].url, "eb": engines[1].url}, headers)


async def registered_themselves(client: httpx.AsyncClient, want: dict[str, str], headers: dict[str, str]) -> None:
    """Wait until the engines of `want` (name -> URL) have registered themselves at `client`'s control plane
    (a fresh database answers their heartbeat 404, and they register). Not a registration written here: one
    that said less than theirs (no host-cache slots) would change each engine's capacity when theirs arrived,
    and the fleet pass would rebalance adapters onto the one that registered itself first."""
    deadline = time.monotonic() + 30
    while True:
        r = await client.get("/v1/engines", headers=headers)
        assert r.status_code == 200, r.text
        seen = {e["name"]: e for e in r.json()["data"]}
        if all(n in seen and seen[n]["url"] == u and seen[n]["max_cpu_loras"] > 0 for n, u in want.items()):
            return
        assert time.monotonic() < deadline, f"the engines did not register: {sorted(seen)}"
        await asyncio.sleep(0.1)


def engine_credentials() -> dict[str, str]:
    """For the control plane's settings: the engines of `lora_engine(name=…)` may fetch artifacts."""
    return dict(CP_TOKENS)


@contextlib.asynccontextmanager
async def served_control_plane(settings: ControlPlaneSettings, port: int) -> AsyncIterator[httpx.AsyncClient]:
    """The control plane over real HTTP on `port` (engines fetch adapter versions from it), and a client."""
    with serve_app(create_app(settings), port) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            yield client


@contextlib.contextmanager
def serve_app(app: Litestar, port: int) -> Iterator[str]:
    """`app` on 127.0.0.1:`port` in a thread of its own (its own event loop) until the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on",
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    thread = threading.Thread(target=server.run, name=f"control-plane:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the control plane did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def engine_adapters(server: EngineServer, name: str) -> dict[str, dict]:
    """name -> listing entry of the adapters engine `name` holds (ready ones, not draining)."""
    body = httpx.get(server.api + "/lora_adapters", headers=engine_auth(name), timeout=10).json()
    return {a["name"]: a for a in body["adapters"] if a["state"] != "draining"}
