"""The engine's wiring of its control-plane client (data_plane.control_client): what it registers (its
served model: data_plane.served_model), the health and slots it reports, its artifact cache's room, the
resolver of unknown names, and the client's start and stop on the app's."""

from __future__ import annotations

from litestar import Litestar

from data_plane.config import EngineConfig
from data_plane.control_client import ControlPlaneClient
from data_plane.engine.protocol import EngineHealth
from data_plane.served_model import served_model


def attach_control_plane(app: Litestar, engine: EngineHealth, config: EngineConfig, engine_url: str,
                         default_name: str) -> ControlPlaneClient:
    """Register, heartbeat (and resolve, unless --no-resolve-adapters) through the control plane for the
    app's lifetime. The returned client's `drain()` is for the engine's shutdown."""
    from data_plane.device import resolve_device  # torch: the engine's process has it loaded already

    assert config.control_plane_url is not None
    cache = app.state.lora.artifact_cache

    def cache_bytes_free() -> int | None:
        return None if cache is None else max(0, cache.max_bytes - cache.size_bytes)

    client = ControlPlaneClient(
        config.control_plane_url, config.control_plane_token, name=config.engine_name or default_name,
        engine_url=engine_url, base_model=config.served_model_name or config.model,
        slots_total=config.max_loras, engine=engine, heartbeat_s=config.heartbeat_interval_s,
        served=served_model(config, resolve_device(config.device).type), cache_bytes_free=cache_bytes_free)
    if config.resolve_adapters:
        app.state.resolver.remote = client.resolve
    app.on_startup.append(client.start)  # after the engine's own start
    app.on_shutdown.insert(0, client.stop)
    return client
