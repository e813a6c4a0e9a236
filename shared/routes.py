"""The routing table and the router's calls to the control plane, defined once for both sides (msgspec).

The router (data_plane/router) keeps no state of its own about where adapters live: it reads this table
from the control plane and asks it for placements.

- `GET /v1/routes` (router token, read or admin token too) → `RoutesTable`, with an `ETag` header; the
  router sends `If-None-Match` every second and gets `304 Not Modified` while nothing changed. `etag`
  in the body is the same value, so a router that logs or caches the table knows which one it holds.
- `POST /v1/routes/demand` (router token) → `DemandAnswer`: the router's presence (`router`), its
  per-model queue figures (`demand`, every interval) and the models it has requests for that nobody holds (`place`, at once, one
  call however many requests wait). The control plane feeds the figures to demand scaling and places
  the named adapters; the answer carries their routes (holders may still be `loading`).

`max_model_len` of a route is the context length of the engines serving its base model (the smallest
when they differ; None when none reported it): the router reserves a tenant's tokens by it when a
request sets no max_tokens.

Ranking (router): residency `device` > `host` > `loading` (placed, not yet served); among equals, the
fewest outstanding requests (power of two choices). `base` models are the engines' served names: every
healthy engine of that base model holds them on device.

Torch-free; extend additively (unknown fields are ignored on decode).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

ROUTES_PATH = "/v1/routes"
DEMAND_PATH = "/v1/routes/demand"

Residency = Literal["device", "host", "loading"]
RESIDENCY_RANK: dict[str, int] = {"device": 0, "host": 1, "loading": 2}  # lower is better
# at most a 32-bit INTEGER column's largest value: the control plane stores a router's counts (routers table),
# and a larger number (which no router holds) was an overflow there, a 500 instead of a 400
MAX_COUNT = 2**31 - 1
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Bounds of one demand report (the control plane answers 400 beyond them): a router reports at most this
# many models per call, and asks for at most MAX_PLACE placements at once.
MAX_DEMAND_MODELS = 10_000
MAX_PLACE = 256
_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"  # no control characters


class RouteEngine(msgspec.Struct, kw_only=True):
    """An engine the router may send requests to (healthy, not draining)."""

    name: str
    # the engine's base URL: the router calls `{url}/v1/chat/completions` with its inference key, unless
    # `inference_url` is set
    url: str
    base_model: str  # the engine's served model name
    # registered with its own engine credential: only then does the router send it the engines' inference
    # key (None: a control plane that does not say; the key is sent, as before)
    credentialed: bool | None = None
    # where inference goes instead of `url`: the OpenAI server of an engine driven by `loraplane agent`
    # (`url` is then the agent's admin API, which serves no inference). None: `url`.
    inference_url: str | None = None

    @property
    def serving_url(self) -> str:
        """The base URL of the engine's inference routes."""
        return self.inference_url or self.url


class Holder(msgspec.Struct, kw_only=True):
    engine: str  # a RouteEngine's name
    residency: Residency


class ModelRoute(msgspec.Struct, kw_only=True):
    model: str  # what a client puts in `model`
    kind: Literal["base", "adapter"]
    base_model: str  # an adapter's base model as engines serve it; a base model's own name
    holders: list[Holder]
    max_model_len: int | None = None  # the context length of its base model's engines (the smallest)


class RoutesTable(msgspec.Struct, kw_only=True):
    etag: str
    engines: list[RouteEngine]
    models: list[ModelRoute]  # base models and active adapters; an adapter nobody holds has no holders


class ModelDemand(msgspec.Struct, kw_only=True):
    model: ModelName
    waiting: Count = 0  # requests the router holds for this model, not yet sent to an engine
    running: Count = 0  # requests sent to an engine and not finished


class RouterPresence(msgspec.Struct, kw_only=True):
    """Who sends the report: the console's Fleet page lists the routers by it (control_plane/domain/routers)."""

    # unique per router process (default host:port); a report replaces that name's row. Printable only:
    # PostgreSQL refuses NUL in text, and the console shows both
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=_PRINTABLE)]
    url: Annotated[str, msgspec.Meta(max_length=1024, pattern=_PRINTABLE)] | None = None  # shown, never called
    running: Count = 0  # requests sent to an engine and not finished, all models
    waiting: Count = 0  # requests held until their adapter is placed
    table_age_s: Annotated[float, msgspec.Meta(ge=0, le=1e9)] | None = None  # since the table was confirmed
    require_api_key: bool = False  # it refuses clients without a key and applies tenants' quotas


class DemandReport(msgspec.Struct, kw_only=True):
    router: RouterPresence | None = None  # a router sends it every report (an idle one every few seconds)
    demand: Annotated[list[ModelDemand], msgspec.Meta(max_length=MAX_DEMAND_MODELS)] = msgspec.field(
        default_factory=list)
    # adapters to place now (nobody holds them)
    place: Annotated[list[ModelName], msgspec.Meta(max_length=MAX_PLACE)] = msgspec.field(default_factory=list)


class DemandAnswer(msgspec.Struct, kw_only=True):
    placed: list[ModelRoute]  # the routes of the models in `place` (holders may be `loading`)
    unknown: list[str]  # names in `place` that are no registered adapter (the router answers 404)
