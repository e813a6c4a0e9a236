"""The LoRA admin endpoints' service: request bodies, and replies composed from the registry, the
engine's per-adapter stats and the per-adapter request statistics. Field names follow vLLM; the reply
shapes are shared.engine_admin's."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from data_plane.adapters.artifact_source import ArtifactSource
from data_plane.adapters.artifacts.cache import ArtifactCache
from data_plane.adapters.entry import AdapterEntry, Residency
from data_plane.adapters.registry import LoRARegistry
from data_plane.adapters.stats import AdapterRequestStats
from data_plane.api.protocol import decode_request
from data_plane.engine.protocol import EngineProtocol
from data_plane.lora.slots import AdapterEngineStats
from shared import engine_admin
from shared.engine_admin import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from shared.errors import InvalidRequestError
from shared.names import ADAPTER_NAME_DESCRIPTION

T = TypeVar("T", bound=msgspec.Struct)

LORA_DISABLED = "LoRA is not enabled on this engine; start it with --enable-lora"


def decode_admin_request(body: bytes, kind: type[T]) -> T:
    """decode_request, with the refusal of a `lora_name` that breaks the name rule worded as the
    registry words it (so every way a bad name is refused reads the same)."""
    try:
        return decode_request(body, kind)
    except InvalidRequestError as exc:
        if exc.param == "lora_name" and ADAPTER_NAME_DESCRIPTION in exc.message:
            raise InvalidRequestError(f"lora_name is not a valid adapter name: {ADAPTER_NAME_DESCRIPTION}",
                                      param="lora_name") from None
        raise


class LoRAService:
    """Replies are the typed structs of shared.engine_admin, which the control plane decodes them with;
    those composed from dicts are converted (and so checked) on the way out."""

    def __init__(
        self, registry: LoRARegistry | None, engine: EngineProtocol, request_stats: AdapterRequestStats, base_name: str,
        artifacts: ArtifactSource | None = None,  # None: LoRA off, or no `artifact` loads (tests)
    ) -> None:
        self._registry = registry
        self._artifacts = artifacts
        self._engine = engine
        self._request_stats = request_stats
        self._base_name = base_name

    @property
    def artifact_cache(self) -> ArtifactCache | None:
        """The cache of versions fetched by digest (None with LoRA off): its room goes in heartbeats."""
        return self._artifacts.cache if self._artifacts is not None else None

    @property
    def registry(self) -> LoRARegistry:
        if self._registry is None:
            raise InvalidRequestError(LORA_DISABLED)
        return self._registry

    async def load(self, body: LoadLoRAAdapterRequest) -> engine_admin.LoadedAdapter:
        registry = self.registry
        if (body.lora_path is None) == (body.artifact is None):
            raise InvalidRequestError(
                "pass exactly one of lora_path (an adapter folder on the engine) and artifact ({digest, url}: "
                "a version fetched from the control plane)", param="artifact" if body.artifact else "lora_path")
        if body.lora_path is not None:
            info = await registry.load(
                body.lora_name, body.lora_path, pinned=body.pinned, load_inplace=body.load_inplace,
                expected_sha256=body.expected_sha256, version=body.version,
            )
        else:
            assert body.artifact is not None
            if self._artifacts is None:
                raise InvalidRequestError("this engine does not fetch artifacts; pass lora_path", param="artifact")
            if body.expected_sha256 not in (None, body.artifact.digest):
                raise InvalidRequestError("expected_sha256 differs from artifact.digest; pass one digest",
                                          param="expected_sha256")
            info = await self._artifacts.load(body.lora_name, body.artifact, pinned=body.pinned,
                                              load_inplace=body.load_inplace, version=body.version)
        return msgspec.convert(info, engine_admin.LoadedAdapter)

    async def unload(self, body: UnloadLoRAAdapterRequest) -> engine_admin.UnloadedAdapter:
        return msgspec.convert(await self.registry.unload(body.lora_name, body.drain_timeout_s),
                               engine_admin.UnloadedAdapter)

    def list(self, *, show_paths: bool) -> engine_admin.AdapterList:
        """show_paths: only admin callers see where adapters lie on the engine's disk (`path` is null else)."""
        registry = self.registry
        engine_lora = self._engine.stats().lora
        adapters = [
            _listing(e, registry.residency(e), engine_lora.adapters.get(e.adapter_id))
            for e in sorted(registry.entries(), key=lambda e: (e.name, e.adapter_id))
        ]
        adapters += [engine_admin.AdapterListing(name=name, path=path, state="loading")
                     for name, path in sorted(registry.loading().items())]
        if not show_paths:
            for adapter in adapters:
                adapter.path = None
        slots = engine_admin.SlotUsage(used=engine_lora.slots_used, total=engine_lora.slots_total)
        return engine_admin.AdapterList(adapters=adapters, slots=slots)

    def stats(self) -> engine_admin.LoraStats:
        registry = self.registry
        per_id = self._engine.stats().lora.adapters
        by_name: dict[str, list[AdapterEntry]] = {}
        for entry in registry.entries():
            by_name.setdefault(entry.name, []).append(entry)
        adapters = []
        for name, versions in sorted(by_name.items()):
            active = max(versions, key=lambda e: e.adapter_id)
            engine = [per_id[e.adapter_id] for e in versions if e.adapter_id in per_id]
            loads = sum(a.loads for a in engine)
            seconds = sum(a.load_seconds_total for a in engine)
            last = [a.last_load_seconds for a in engine if a.last_load_seconds is not None]
            adapters.append(
                {
                    "name": name,
                    "id": active.adapter_id,
                    **self._request_stats.snapshot(name),
                    "loads": loads,
                    "evictions": sum(a.evictions for a in engine),
                    "load_seconds": {
                        "total": seconds,
                        "mean": seconds / loads if loads else None,
                        "last": last[-1] if last else None,
                    },
                }
            )
        base = {"name": self._base_name, "id": 0, **self._request_stats.snapshot(self._base_name)}
        return msgspec.convert({"base": base, "adapters": adapters}, engine_admin.LoraStats)


def _listing(
    entry: AdapterEntry, residency: Residency, engine: AdapterEngineStats | None
) -> engine_admin.AdapterListing:
    """The load reply's fields plus the entry's state and queues (engine: None while the engine has
    no figures for it: it has not been scheduled since its load)."""
    return engine_admin.AdapterListing(
        **entry.info(residency),
        path=entry.path,
        pinned=entry.pinned,
        state=entry.state.value,
        in_flight=entry.in_flight,
        running=engine.running if engine is not None else 0,
        waiting=engine.waiting if engine is not None else 0,
        loaded_at=entry.loaded_at,
        last_used_at=entry.last_used_at,
    )
