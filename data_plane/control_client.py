"""The engine's side of the control plane: register at start, heartbeat, resolve unknown adapter names.

`attach_control_plane(app, …)` (called by server.py when --control-plane is given) starts a background
task on the app's startup that registers the engine (retrying until the control plane answers) and then
heartbeats every HEARTBEAT_S seconds, registering again if the control plane forgot it (404). It also
gives the ModelResolver a `remote`: GET /v1/resolve/{name}?base_model=… → the folder to load, or None.
The control-plane token is sent only as a bearer header; it is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import quote

import httpx
from litestar import Litestar

from data_plane.config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 3.0
TIMEOUT_S = 5.0


class ControlPlaneClient:
    def __init__(self, url: str, token: str | None, *, name: str, engine_url: str, base_model: str,
                 slots_total: int, engine: Any = None, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.engine_url = engine_url
        self.base_model = base_model
        self.slots_total = slots_total
        self.heartbeat_s = heartbeat_s
        self._engine = engine
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._http = httpx.AsyncClient(headers=self._headers, timeout=TIMEOUT_S)
        self._task = asyncio.create_task(self._run(), name="control-plane-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.aclose()

    async def resolve(self, name: str) -> str | None:
        """The folder of `name`'s active version for this engine's base model; None when not registered
        (or when the control plane cannot be asked: the request then gets the usual 404)."""
        assert self._http is not None, "start() first"
        try:
            r = await self._http.get(f"{self.url}/v1/resolve/{quote(name, safe='/')}",
                                     params={"base_model": self.base_model, "engine": self.name})
        except httpx.HTTPError as exc:
            logger.warning("control plane unreachable resolving %s: %s", name, type(exc).__name__)
            return None
        if r.status_code != 200:
            if r.status_code != 404:
                logger.warning("control plane answered %d resolving %s", r.status_code, name)
            return None
        return r.json()["uri"]

    async def _run(self) -> None:
        registered = False
        while True:
            try:
                registered = await self._heartbeat() if registered else await self._register()
            except httpx.HTTPError as exc:
                logger.warning("control plane %s unreachable: %s", self.url, type(exc).__name__)
            await asyncio.sleep(self.heartbeat_s)

    async def _register(self) -> bool:
        assert self._http is not None
        body = {"name": self.name, "url": self.engine_url, "base_model": self.base_model,
                "slots_total": self.slots_total}
        r = await self._http.post(f"{self.url}/v1/engines/register", json=body)
        if r.status_code != 200:
            logger.error("control plane refused the registration of %s: %d %s", self.name, r.status_code,
                         r.text[:300])
            return False
        logger.info("registered with the control plane %s as %s (%s)", self.url, self.name, self.engine_url)
        return True

    async def _heartbeat(self) -> bool:
        assert self._http is not None
        r = await self._http.post(f"{self.url}/v1/engines/{quote(self.name, safe='/:')}/heartbeat",
                                  json={"slots_used": self._slots_used()})
        if r.status_code == 404:  # the control plane forgot this engine (deleted, or a fresh database)
            return await self._register()
        if r.status_code != 200:
            logger.warning("control plane answered the heartbeat with %d", r.status_code)
        return True

    def _slots_used(self) -> int:
        try:
            return int(getattr(self._engine.stats().lora, "slots_used", 0))
        except Exception:
            return 0


def attach_control_plane(app: Litestar, engine: Any, config: EngineConfig, engine_url: str,
                         default_name: str) -> ControlPlaneClient:
    """Register, heartbeat and resolve through the control plane for the app's lifetime."""
    assert config.control_plane_url is not None
    client = ControlPlaneClient(
        config.control_plane_url, config.control_plane_token, name=config.engine_name or default_name,
        engine_url=engine_url, base_model=config.served_model_name or config.model, slots_total=config.max_loras,
        engine=engine)
    app.state.resolver.remote = client.resolve
    app.on_startup.append(client.start)  # after the engine's own start
    app.on_shutdown.insert(0, client.stop)
    return client
