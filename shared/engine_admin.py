"""Wire shapes between engines and the control plane, defined once for both sides (msgspec, torch-free).

- AdapterDescription: what one version of an adapter is. Every message and record that describes a
  version embeds it (a Struct subclass keeps its fields flat in JSON): the engine's replies below, the
  control plane's answers, the engine's in-memory adapters and the control plane's inspection of a folder.
- The control plane's LoRA admin requests (load, unload: vLLM's field names and loraplane's extras).
- The engine's LoRA admin replies (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
  `GET /v1/lora_adapters`, `GET /v1/lora_stats`): the engine builds them, the control plane decodes
  every reply with them, so that an engine answering `[1,2,3]` or garbage is one failed engine call
  (EngineCallError), never an exception deep in the control plane's own code.
- What an engine sends the control plane: its registration and heartbeat bodies, and what it reads
  back from `GET /v1/resolve/{name}`.

Unknown fields are ignored on decode (msgspec's default), so either side may add fields without
breaking the other; a field one side relies on is required, everything else has a default (the
description is whole wherever a version is described: every engine has always sent it). Extend
additively.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from shared.artifacts import ArtifactRef
from shared.names import AdapterName

Name = AdapterName  # engine names follow the adapter name rule
Count = Annotated[int, msgspec.Meta(ge=0)]
Slots = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
# A byte count the control plane stores in a 64-bit column (a larger one was a 500).
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Sha256 = Annotated[str, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
# A context length in tokens, stored in a 32-bit column.
ContextLength = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
# A reason for an unhealthy engine: short, shown in listings and logs.
Reason = Annotated[str, msgspec.Meta(max_length=512)]


class AdapterDescription(msgspec.Struct, kw_only=True):
    """One version of an adapter: the manifest digest of its files (shared.manifest: its identity), the
    largest rank of any module, lora_alpha, the projections it adapts (short names, shared.peft's
    TARGET_MODULES order) and its files' total size. Where its files lie is not part of it."""

    sha256: Sha256
    rank: Count
    alpha: float
    target_modules: list[Text]
    size_bytes: Count


def _unknown_yet(struct: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """`struct`'s fields, each `T | None` and None by default: for a row that may not know them yet."""
    fields = [(f.name, f.type | None, None) for f in msgspec.structs.fields(struct)]
    return msgspec.defstruct(f"Partial{struct.__name__}", fields, kw_only=True, module=__name__)


# ---- control plane → engine requests ----------------------------------------------------------
# No NUL (the OS cannot take one) and no longer than Linux's PATH_MAX.
AdapterPath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern="^[^\\x00]*$",
                                          description="the adapter folder, under one of the engine's --lora-roots")]


HexSha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$", description="hex sha256")]


class LoadLoRAAdapterRequest(msgspec.Struct):
    """vLLM's load request; `pinned`, `load_inplace`, `expected_sha256` and `artifact` are loraplane's
    extras. Exactly one of `lora_path` (a folder on the engine, under --lora-roots) and `artifact` (a
    version the engine fetches from its control plane by digest, verifies and caches) names the files."""

    lora_name: Name
    lora_path: AdapterPath | None = None
    pinned: bool = False
    load_inplace: bool = False
    # The version's manifest digest (shared.manifest) as the control plane recorded it: the engine
    # digests what it read and refuses other content with a 409 `sha256_mismatch`, loading nothing.
    expected_sha256: HexSha256 | None = None
    artifact: ArtifactRef | None = None
    # the control plane registry's version number of these files: the engine lists it as `version`
    version: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)] | None = None


class UnloadLoRAAdapterRequest(msgspec.Struct):
    lora_name: Name
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] | None = None


# ---- engine replies (engine → control plane) ---------------------------------------------------
RegistryVersion = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]


class LoadedAdapter(AdapterDescription, kw_only=True):
    """Reply of POST /v1/load_lora_adapter: the version now active under `name`. `version` is the
    control plane registry's version number, when the load came from it (None for a folder loaded
    directly); `load_generation` is the engine's own count of the contents it loaded under the name."""

    name: Text
    id: Count
    version: RegistryVersion | None = None
    load_generation: Count | None = None
    residency: Text | None = None  # device | host | disk


class UnloadedAdapter(msgspec.Struct, kw_only=True):
    """Reply of POST /v1/unload_lora_adapter."""

    name: Text
    drained: bool = True  # False: in-flight requests were aborted after the drain timeout
    aborted: Count = 0


if TYPE_CHECKING:
    # What _unknown_yet(AdapterDescription) makes, spelled out for the checker (which cannot follow a class
    # made at run time): AdapterDescription's fields, each `T | None` and None by default.
    class _PartialAdapterDescription(msgspec.Struct, kw_only=True):
        sha256: Sha256 | None = None
        rank: Count | None = None
        alpha: float | None = None
        target_modules: list[Text] | None = None
        size_bytes: Count | None = None
else:
    _PartialAdapterDescription = _unknown_yet(AdapterDescription)


class AdapterListing(_PartialAdapterDescription, kw_only=True):
    """One row of GET /v1/lora_adapters. A first load still reading its files has only name, path and
    state (`loading`); the other fields are None then."""

    name: Text
    state: Text  # loading | ready | draining
    id: Count | None = None
    version: RegistryVersion | None = None  # the registry's version (LoadedAdapter)
    load_generation: Count | None = None
    path: Text | None = None  # may be left out of unauthenticated listings
    residency: Text | None = None
    pinned: bool = False
    in_flight: Count = 0
    running: Count = 0
    waiting: Count = 0
    loaded_at: float | None = None
    last_used_at: float | None = None


class SlotUsage(msgspec.Struct, kw_only=True):
    used: Count = 0
    total: Count = 0


class AdapterList(msgspec.Struct, kw_only=True):
    """Reply of GET /v1/lora_adapters."""

    adapters: list[AdapterListing]
    slots: SlotUsage = msgspec.field(default_factory=SlotUsage)


class Percentiles(msgspec.Struct, kw_only=True):
    p50: float | None = None
    p99: float | None = None
    samples: Count = 0


class LoadSeconds(msgspec.Struct, kw_only=True):
    total: float = 0.0
    mean: float | None = None
    last: float | None = None


class RequestFigures(msgspec.Struct, kw_only=True):
    """Request statistics of one served model (an adapter or the base model)."""

    name: Text
    id: Count
    requests: dict[Text, Count] = msgspec.field(default_factory=dict)  # by outcome
    prompt_tokens: Count = 0
    generated_tokens: Count = 0
    ttft_seconds: Percentiles = msgspec.field(default_factory=Percentiles)
    e2e_seconds: Percentiles = msgspec.field(default_factory=Percentiles)
    generated_tokens_per_second_1m: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class AdapterFigures(RequestFigures, kw_only=True):
    loads: Count = 0
    evictions: Count = 0
    load_seconds: LoadSeconds = msgspec.field(default_factory=LoadSeconds)


class LoraStats(msgspec.Struct, kw_only=True):
    """Reply of GET /v1/lora_stats."""

    base: RequestFigures
    adapters: list[AdapterFigures]


# ---- engine → control plane requests -----------------------------------------------------------
EngineKind = Literal["loraplane", "vllm"]  # the engines the fleet drives; a kind ships with a test against it
HttpUrl = Annotated[str, msgspec.Meta(pattern=r"^[hH][tT][tT][pP][sS]?://\S+$", max_length=1024)]


class EngineRegistration(msgspec.Struct, kw_only=True):
    """POST /v1/engines/register: idempotent by name (a re-registration updates everything below).
    The control plane checks `url` further (scheme, host, no userinfo/query/fragment/path, networks).

    What the engine serves besides its served name (`base_model`), so that an adapter naming its base
    model by hub id, path or config digest finds it: the checkpoint's `_name_or_path` (config.json), the
    model folder, the sha256 of config.json; and what it can hold: device slots (`slots_total`, its
    --max-loras), the rank slots are padded to, the host cache's slots (--max-cpu-loras), its context
    length (`max_model_len`: routers reserve a tenant's tokens by it when a request sets no max_tokens).

    `kind` says which engine serves: `loraplane` (this project's engine; `url` serves both the admin
    API and inference) or the kind of an engine driven by `loraplane agent` (`vllm`): `url` is then the
    agent's admin API and `inference_url` the engine's OpenAI server, where routers send inference
    (checked by the same address rules as `url`). Without `inference_url`, inference goes to `url`."""

    name: Name
    url: HttpUrl
    kind: EngineKind = "loraplane"
    inference_url: HttpUrl | None = None
    base_model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    slots_total: Slots = 0
    model_name_or_path: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    model_path: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    config_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None
    device_kind: Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9_]{0,31}$")] | None = None  # cpu | cuda | npu
    max_lora_rank: Slots | None = None
    max_cpu_loras: Slots | None = None
    max_model_len: ContextLength | None = None


class EngineHeartbeat(msgspec.Struct, kw_only=True):
    """POST /v1/engines/{name}/heartbeat. `healthy` false (its step loop died: `reason` says why) or
    `draining` true (shutting down) makes the control plane give the engine no new placements at once."""

    slots_used: Slots | None = None
    slots_total: Slots | None = None
    healthy: bool = True
    draining: bool = False
    reason: Reason | None = None
    # free room of the engine's artifact cache (--lora-cache-dir) under --lora-cache-max-bytes; None: no cache
    cache_bytes_free: ByteCount | None = None


class ResolvedAdapter(msgspec.Struct, kw_only=True):
    """Reply of GET /v1/resolve/{name}: what the engine loads to serve `name` (its active version)."""

    name: Text
    version: Count
    uri: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    sha256: Sha256
    # where the engine fetches the version by digest (shared.artifacts); when given, `uri` is not read
    artifact: ArtifactRef | None = None
