"""AgentRuntime: one agent's parts and their lifetime (started and stopped with the app).

At start: the artifact cache opens on --adapter-dir (one process per folder: its flock), the watch starts,
and a task waits until the engine lists what it serves, then registers with the control plane as an
engine of its kind: `url` is the agent's admin API, `inference_url` the engine's server, `base_model`
and `max_model_len` the engine's own, `slots_total` its adapter slots (the engine's figure, else
--max-loras), `max_lora_rank` the flag's. The control-plane client (data_plane.control_client) then
heartbeats with the watch's health; the watch makes it register again after an engine restart. An engine
with no API key (LORAPLANE_ENGINE_API_KEY) on a non-loopback address gets a warning: anyone who reaches
it can load and unload adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from pathlib import Path
from urllib.parse import urlsplit

from data_plane.adapters.artifacts.cache import ArtifactCache
from data_plane.adapters.artifacts.fetch import ArtifactFetcher, ArtifactOrigins
from data_plane.agent.adapters import AgentAdapters
from data_plane.agent.config import AgentConfig
from data_plane.agent.kind import EngineCallFailed, EngineKind, Served
from data_plane.agent.vllm import VllmEngine
from data_plane.agent.watch import EngineWatch
from data_plane.background import read_off_loop
from data_plane.control_client import ControlPlaneClient

logger = logging.getLogger(__name__)
RETRY_S = 1.0  # how often an engine that does not answer yet is asked again at start


def engine_for(config: AgentConfig) -> EngineKind:
    """The class of --engine-kind."""
    assert config.engine_kind == "vllm", config.engine_kind  # AgentConfig checks the choices
    return VllmEngine(config.engine_url, timeout_s=config.engine_timeout_s, api_key=config.engine_api_key)


class AgentRuntime:
    def __init__(self, config: AgentConfig, admin_url: str, default_name: str) -> None:
        self.config = config
        self.admin_url = admin_url
        self.name = config.engine_name or default_name
        self.engine = engine_for(config)
        fetcher = ArtifactFetcher(ArtifactOrigins(config.control_plane_url, config.lora_artifact_endpoint),
                                  config.control_plane_token, max_bytes=config.lora_cache_max_bytes)
        self.cache = ArtifactCache(Path(config.adapter_dir), config.lora_cache_max_bytes, fetcher)
        self.adapters = AgentAdapters(self.engine, self.cache, max_loras=config.max_loras)
        self.watch = EngineWatch(self.engine, self.adapters, config.watch_interval_s, on_restart=self._restarted)
        self.client: ControlPlaneClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await read_off_loop(self.cache.open)
        self._tasks = [asyncio.create_task(self.watch.run(), name="engine-watch"),
                       asyncio.create_task(self._register(), name="engine-register")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.client is not None:
            await self.client.stop()
        await self.cache.settle()
        await read_off_loop(self.cache.close)
        await self.cache.fetcher.aclose()
        await self.engine.aclose()

    async def _register(self) -> None:
        served = await self._first_listing()
        self.adapters.observe(served)
        self._warn_if_open()
        config = self.config
        self.client = ControlPlaneClient(
            config.control_plane_url, config.control_plane_token, name=self.name, engine_url=self.admin_url,
            base_model=served.base_model, slots_total=self.adapters.max_loras or 0, engine=self.watch,
            heartbeat_s=config.heartbeat_interval_s, cache_bytes_free=self._cache_bytes_free,
            registration={"kind": config.engine_kind, "inference_url": self.engine.url,
                          "model_path": served.model_path, "max_lora_rank": config.max_lora_rank,
                          "max_model_len": served.max_model_len})
        await self.client.start()

    async def _first_listing(self) -> Served:
        waited = False
        while True:
            try:
                return await self.engine.listing()
            except EngineCallFailed as exc:
                if not waited:
                    logger.info("waiting for the engine at %s: %s", self.engine.url, exc.message)
                    waited = True
            await asyncio.sleep(RETRY_S)

    def _restarted(self) -> None:
        if self.client is not None:
            self.client.register_again()

    def _cache_bytes_free(self) -> int:
        return max(0, self.cache.max_bytes - self.cache.size_bytes)

    def _warn_if_open(self) -> None:
        if self.config.engine_api_key:
            return
        host = urlsplit(self.engine.url).hostname or ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            logger.warning("the engine at %s answers without an API key on a non-loopback address: whoever reaches "
                           "it can load and unload adapters; start it with --api-key (and give the agent "
                           "LORAPLANE_ENGINE_API_KEY) or keep it behind a network policy", self.engine.url)
