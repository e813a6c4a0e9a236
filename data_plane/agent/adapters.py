"""AgentAdapters: the engine admin contract (shared.engine_admin) carried out on an engine of another kind.

Load (`artifact` only: the agent serves versions from the artifact store, by digest):
1. the version is fetched into `--adapter-dir/<digest>/` by the engine's own artifact modules
   (data_plane.adapters.artifacts: fetch with every file's sha256 checked, LRU cache), or found there;
2. its files are on disk (`on_disk`) and each still hashes to the manifest (`check_files`: a cached copy
   changed since it was verified is dropped and fetched again, once), before the engine is told of them;
3. the engine loads that folder, which is always `--adapter-dir/<digest>`, never a path from the body;
   `load_inplace` is passed to the engine when it serves the name with other files already. The same
   digest under the same name is a no-op; other files without the body's `load_inplace` are a 409.
Unload: the engine's unload (404 when it does not serve the name); the files stay in the cache, which
evicts them (least recently used first) once they are not served and room is needed (--lora-cache-max-bytes).

Listing and stats are read from the engine each time, so what it lost (a restart) is not listed, and the
control plane's reconcile loads it again. An adapter's version is known by its folder (`<digest>`); its
description is read from the cached files. Residency is `loaded` (vLLM cannot say device or host).
The engine names the adapters with requests running or waiting but does not count them: `running` is 1
for an adapter it names (at least one request), `waiting` always 0, so that what the control plane's demand
scaling adds from this engine is a lower bound and the routers' in-flight requests per adapter decide.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import msgspec

from data_plane.adapters.artifacts.cache import ArtifactCache
from data_plane.adapters.keyed_lock import KeyedLock
from data_plane.agent.kind import EngineKind, Figures, Served
from data_plane.background import read_off_loop
from shared import engine_admin
from shared.artifacts import DIGEST_PATTERN, ArtifactManifest, ArtifactRef
from shared.errors import ConflictError, InvalidRequestError, NotFoundError
from shared.peft import (
    CONFIG_NAME,
    TARGET_MODULES,
    WEIGHTS_NAME,
    AdapterFilesError,
    TargetSpec,
    parse_lora_key,
    read_config,
)
from shared.safetensors_header import read_header

RESIDENCY = "loaded"  # what an engine of another kind says of where an adapter lies
_DIGEST = re.compile(DIGEST_PATTERN)


class _ChangedCopy(Exception):
    """The cached copy no longer hashes to its digest."""


def describe(folder: Path, manifest: ArtifactManifest) -> engine_admin.AdapterDescription:
    """Blocking: the version's description from its verified files (rank: the largest of its modules)."""
    spec = TargetSpec.from_peft_config(read_config((folder / CONFIG_NAME).read_bytes()))
    ranks: dict[str, int] = {}
    for key, info in read_header(folder / WEIGHTS_NAME).items():
        parsed = parse_lora_key(key)
        if parsed is not None and parsed.short is not None and parsed.ab == "lora_A" and info.shape:
            ranks[parsed.short] = max(ranks.get(parsed.short, 0), info.shape[0])
    return engine_admin.AdapterDescription(
        sha256=manifest.digest, rank=max(ranks.values(), default=spec.r), alpha=float(spec.lora_alpha),
        target_modules=sorted(ranks, key=TARGET_MODULES.index), size_bytes=manifest.size_bytes)


class AgentAdapters:
    def __init__(self, engine: EngineKind, cache: ArtifactCache, *, max_loras: int | None = None) -> None:
        self.engine = engine
        self.cache = cache
        self.max_loras = max_loras  # the flag's; the engine's own once it says it (Figures.max_loras)
        self.served_count = 0  # adapters the engine served at the last look (the heartbeat's slots in use)
        self._served: set[str] = set()  # their digests: never evicted from the cache
        cache.in_use = lambda: self._served
        self._locks = KeyedLock()
        self._descriptions: dict[str, engine_admin.AdapterDescription] = {}  # digest -> its description
        self._versions: dict[tuple[str, str], int | None] = {}  # (name, digest) -> the registry's version
        self._ids: dict[str, int] = {}
        self._loaded_at: dict[str, float] = {}
        self._loads: Counter[str] = Counter()
        self._load_seconds: dict[str, list[float]] = {}

    # ---- load / unload -------------------------------------------------------------------------
    async def load(self, body: engine_admin.LoadLoRAAdapterRequest) -> engine_admin.LoadedAdapter:
        if body.artifact is None:
            raise InvalidRequestError("loraplane agent loads versions from the artifact store only: pass artifact "
                                      "({digest, url}), not lora_path", param="lora_path")
        ref, name = body.artifact, body.lora_name
        if body.expected_sha256 not in (None, ref.digest):
            raise InvalidRequestError("expected_sha256 differs from artifact.digest; pass one digest",
                                      param="expected_sha256")
        async with self._locks(name):
            served = self.observe(await self.engine.listing())
            current = self._digest_of(served.adapters.get(name))
            if current == ref.digest:  # the same files under the same name: nothing to do
                self._versions[(name, ref.digest)] = body.version or self._versions.get((name, ref.digest))
                return await self._loaded(name, ref.digest)
            if name in served.adapters and not body.load_inplace:
                raise ConflictError(f"{name} is loaded with other files; pass load_inplace to replace them",
                                    param="lora_name")
            inplace = name in served.adapters
            try:
                await self._load(name, ref, inplace)
            except _ChangedCopy:
                await self.cache.discard(ref.digest)  # verified once, changed since: fetch it again
                try:
                    await self._load(name, ref, inplace)
                except _ChangedCopy:
                    raise AdapterFilesError(f"checksum mismatch: the files of {ref.digest[:16]}… changed on disk "
                                            "right after they were fetched", param="artifact",
                                            code="checksum_mismatch") from None
            self._versions[(name, ref.digest)] = body.version
            self._served.add(ref.digest)
            self._loaded_at[name] = time.time()
            return await self._loaded(name, ref.digest)

    async def _load(self, name: str, ref: ArtifactRef, inplace: bool) -> None:
        async with self.cache.acquire(ref) as folder:  # held: not evicted while the engine reads it
            await self.cache.on_disk(ref.digest)
            try:
                manifest = await read_off_loop(self.cache.check_files, ref.digest)
            except AdapterFilesError:
                raise _ChangedCopy from None
            folder = folder.resolve()
            if folder != self.cache.root.resolve() / ref.digest:  # a link could lead anywhere
                raise InvalidRequestError(f"the folder of {ref.digest[:16]}… is not inside --adapter-dir",
                                          param="artifact")
            if ref.digest not in self._descriptions:
                self._descriptions[ref.digest] = await read_off_loop(describe, folder, manifest)
            started = time.monotonic()
            await self.engine.load(name, folder, inplace)
            self._loads[name] += 1
            self._load_seconds.setdefault(name, []).append(time.monotonic() - started)

    async def unload(self, body: engine_admin.UnloadLoRAAdapterRequest) -> engine_admin.UnloadedAdapter:
        async with self._locks(body.lora_name):
            if not await self.engine.unload(body.lora_name):
                raise NotFoundError(f"No adapter named {body.lora_name!r} is loaded.", param="lora_name")
            self._loaded_at.pop(body.lora_name, None)
            self.observe(await self.engine.listing())
        return engine_admin.UnloadedAdapter(name=body.lora_name)

    # ---- what the engine serves ----------------------------------------------------------------
    def observe(self, served: Served) -> Served:
        """Remember what the engine serves (the cache keeps those digests; the heartbeat counts them)."""
        self._served = {d for d in map(self._digest_of, served.adapters.values()) if d is not None}
        self.served_count = len(served.adapters)
        return served

    def observe_figures(self, figures: Figures) -> None:
        if figures.max_loras is not None:
            self.max_loras = figures.max_loras

    def forget(self) -> None:
        """The engine restarted: it serves nothing loaded before."""
        self._served, self.served_count = set(), 0
        self._loaded_at.clear()

    async def list(self) -> engine_admin.AdapterList:
        served, figures = await asyncio.gather(self.engine.listing(), self.engine.stats())
        self.observe(served)
        self.observe_figures(figures)
        adapters = []
        for name, path in sorted(served.adapters.items()):
            digest = self._digest_of(path)
            description = self._descriptions.get(digest) if digest is not None else None
            known = msgspec.structs.asdict(description) if description is not None else {}
            adapters.append(engine_admin.AdapterListing(
                **known, name=name, state="ready", id=self._id(name), path=path, residency=RESIDENCY,
                version=self._versions.get((name, digest)) if digest is not None else None,
                running=int(name in figures.running or name in figures.waiting),
                loaded_at=self._loaded_at.get(name)))
        slots = engine_admin.SlotUsage(used=len(adapters), total=self.max_loras or 0)
        return engine_admin.AdapterList(adapters=adapters, slots=slots)

    async def stats(self) -> engine_admin.LoraStats:
        served, figures = await asyncio.gather(self.engine.listing(), self.engine.stats())
        self.observe(served)
        model = served.base_model
        base = engine_admin.RequestFigures(name=model, id=0, requests=dict(figures.requests.get(model, {})),
                                           prompt_tokens=figures.prompt_tokens.get(model, 0),
                                           generated_tokens=figures.generated_tokens.get(model, 0))
        adapters = []
        for name in sorted(served.adapters):
            seconds = self._load_seconds.get(name, [])
            loads = self._loads[name]
            adapters.append(engine_admin.AdapterFigures(
                name=name, id=self._id(name), requests=dict(figures.requests.get(name, {})),
                prompt_tokens=figures.prompt_tokens.get(name, 0),
                generated_tokens=figures.generated_tokens.get(name, 0), loads=loads,
                load_seconds=engine_admin.LoadSeconds(total=sum(seconds), mean=sum(seconds) / loads if loads else None,
                                                      last=seconds[-1] if seconds else None)))
        return engine_admin.LoraStats(base=base, adapters=adapters)

    # ---- helpers -------------------------------------------------------------------------------
    def _digest_of(self, path: str | None) -> str | None:
        """The digest of a folder of the cache (`--adapter-dir/<digest>`); None for any other path."""
        if path is None:
            return None
        folder = Path(path)
        if folder.parent != self.cache.root or not _DIGEST.fullmatch(folder.name):
            return None
        return folder.name

    def _id(self, name: str) -> int:
        return self._ids.setdefault(name, len(self._ids) + 1)

    async def _loaded(self, name: str, digest: str) -> engine_admin.LoadedAdapter:
        description = self._descriptions.get(digest)
        if description is None:  # served since before this process started: read it off the cached files
            manifest = await read_off_loop(self.cache.check_files, digest)
            description = await read_off_loop(describe, self.cache.root / digest, manifest)
            self._descriptions[digest] = description
        return engine_admin.LoadedAdapter(
            **msgspec.structs.asdict(description), name=name, id=self._id(name),
            version=self._versions.get((name, digest)), load_generation=self._loads[name], residency=RESIDENCY)

