"""Wire schemas of the adapter registry (msgspec): `X` for answers, `XCreate` / `X…` requests.

AdapterCreate is a superset of vLLM's load request (`lora_name`, `lora_path`), so a client written for
vLLM can register adapters here unchanged.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec

from control_plane.domain.placements.push import EngineOutcome
from shared.artifacts import ArtifactRef
from shared.engine_admin import AdapterDescription
from shared.names import AdapterName

# Labels are bounded in number and size (the schema says so, and msgspec enforces it before any work):
# unbounded, 20,000 labels were once accepted into one row.
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 64, 63, 256
LabelKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_KEY)]
LabelValue = Annotated[str, msgspec.Meta(max_length=MAX_LABEL_VALUE)]
Labels = Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=MAX_LABELS)]
LABELS_RULE = msgspec.Meta(description=f"at most {MAX_LABELS} labels; keys 1–{MAX_LABEL_KEY} characters, "
                                       f"values at most {MAX_LABEL_VALUE}")
MAX_VERSION = (1 << 31) - 1  # a version number the database's integer column holds (larger was a 500)
# A listing's label filter: `key` (present) or `key=value` (equal).
# no NUL: SQLite's JSON path cannot hold one (a filter with one was a 500)
LabelFilter = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_KEY + 1 + MAX_LABEL_VALUE,
                                          pattern="^[^\\x00]*$")]
MAX_NAMED_ENGINES = 1024  # engine names follow the adapter name rule (shared.names)
# A folder path: no NUL (the OS cannot take one: a 400 here, not an error deeper down) and bounded in length.
AdapterPath = Annotated[str, msgspec.Meta(min_length=1, max_length=1024, pattern="^[^\\x00]*$",
                                          description="the adapter folder, under the adapter roots")]


MAX_REPLICAS = 4096
ReplicaMin = Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
ReplicaMax = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)]


class ReplicasSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How many engines hold the adapter: at least `min`, at most `max` ("all": every engine of its base
    model); demand scaling moves between them. A field left out or null is the control plane's default
    (--default-min-replicas, --default-max-replicas)."""

    min: ReplicaMin | None = None
    max: ReplicaMax | Literal["all"] | None = None


class AdapterCreate(msgspec.Struct, kw_only=True):
    """POST /v1/load_lora_adapter."""

    lora_name: AdapterName
    lora_path: AdapterPath
    base_model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    pinned: bool = False
    engines: Annotated[list[AdapterName], msgspec.Meta(max_length=MAX_NAMED_ENGINES)] | None = None
    description: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    labels: Annotated[Labels | None, LABELS_RULE] = None  # described beside the union: the document shows it
    replicas: ReplicasSpec | None = None  # None: an existing adapter keeps its own, a new one the defaults


BaseModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern="^[^\\s\\x00]([^\\x00]*[^\\s\\x00])?$",
                                            description="the base model: an engine's served name, a model "
                                            "path or id, or a config digest; no surrounding spaces")]


class AdapterUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """PATCH /v1/lora_adapters/{name}: the adapter's replica counts (both fields replaced), whether its
    replicas are pinned (kept in a device slot, never evicted) and its base model (re-targeting it: an
    admin token only); at least one of them, a field left out (or null) is left as it is."""

    replicas: ReplicasSpec | None = None
    pinned: bool | None = None
    base_model: BaseModelName | None = None


class AdapterUnload(msgspec.Struct, kw_only=True):
    """POST /v1/unload_lora_adapter (vLLM's request)."""

    lora_name: AdapterName


class AdapterActivate(msgspec.Struct, kw_only=True):
    """POST /v1/lora_adapters/{name}/activate: which existing version becomes the pin."""

    version: Annotated[int, msgspec.Meta(ge=1, le=MAX_VERSION)]


def push_status(engines: list[EngineOutcome]) -> int:
    """200 when every engine succeeded (or none was involved), 207 when some failed, 502 when all did."""
    failed = sum(e.outcome == "failed" for e in engines)
    if not failed:
        return 200
    return 502 if failed == len(engines) else 207


class AdapterLoaded(AdapterDescription, kw_only=True):
    name: str
    version: int
    created: bool  # False when identical files were registered before: the existing version was reused
    engines: list[EngineOutcome]
    # set when no engine could take it yet (none serves its base model, or none is healthy): it is placed
    # as soon as one registers or recovers; or when every engine refused it, so the version active
    # before stays active
    warning: str | None = None
    active_version: int | None = None  # the adapter's active version after the call (None: not activated)


class AdapterUnloaded(msgspec.Struct, kw_only=True):
    name: str
    engines: list[EngineOutcome]


class AdapterVersion(AdapterDescription, kw_only=True):
    number: int
    uri: str
    created_at: dt.datetime
    # who registered it: `<role>:<token id>`, as audit events name actors; null for versions made before
    # the control plane recorded it
    created_by: str | None = None


class Placement(msgspec.Struct, kw_only=True):
    engine: str
    version: int
    desired: str
    observed: str
    last_error: str | None
    residency: str | None = None  # device | host, as the engine last said (loaded ones)
    updated_at: dt.datetime


class Adapter(msgspec.Struct, kw_only=True):
    name: str
    base_model: str
    description: str
    labels: dict[str, str]
    active_version: int | None
    owner: str | None  # the tenant that owns it (null: nobody's), as /v1/tenancy/adapters says
    public: bool  # usable by every tenant's keys, not only its owner's
    created_at: dt.datetime
    updated_at: dt.datetime


class Replicas(msgspec.Struct, kw_only=True):
    min: int
    max: int | Literal["all"]
    target: int  # what the replica rules ask for now: min, or what demand scaling raised it to
    current: int  # healthy engines desired to hold it


class ScaleDecision(msgspec.Struct, kw_only=True):
    """Demand scaling's last change of the target, with its reason and the figures behind it."""

    at: dt.datetime
    from_: int = msgspec.field(name="from")
    to: int
    reason: str
    figures: dict[str, float]


class AdapterDetail(Adapter, kw_only=True):
    pinned: bool  # its replicas are desired pinned (PATCH `pinned`, or a load with `pinned`)
    versions: list[AdapterVersion]
    placements: list[Placement]
    replicas: Replicas
    last_decision: ScaleDecision | None = None


class AdapterUpdated(AdapterDetail, kw_only=True):
    engines: list[EngineOutcome]  # replicas added or let go at once (a re-target: released and placed)
    # a re-target no engine could take yet (none serves the new base model, or none is healthy)
    warning: str | None = None


class AdapterActivated(AdapterDetail, kw_only=True):
    engines: list[EngineOutcome]
    warning: str | None = None  # set when every engine refused the version: the one active before stays so


class AdapterResolved(msgspec.Struct, kw_only=True):
    """GET /v1/resolve/{name}: what an engine loads to serve `name` (the active version)."""

    name: str
    version: int
    uri: str
    sha256: str
    # where the engine fetches the version by digest; when present the engine does not read `uri`
    artifact: ArtifactRef | None = None


class AdapterPage(msgspec.Struct, kw_only=True):
    data: list[Adapter]
    total: int
    limit: int
    offset: int


class AdapterDeleted(msgspec.Struct, kw_only=True):
    name: str
    deleted: bool = True


class VersionDeleted(msgspec.Struct, kw_only=True):
    """DELETE /v1/lora_adapters/{name}/versions/{version}."""

    name: str
    version: int
    deleted: bool = True
