"""The engine's side of the control plane: register at start, heartbeat, drain, resolve unknown adapter names.

`ControlPlaneClient.start()` (the engine's wiring: data_plane/api/control_plane.py; `loraplane agent`'s:
data_plane/agent/) starts a background task that registers the engine (retrying until the control plane answers) and then
heartbeats every --heartbeat-interval-s (HEARTBEAT_S by default), registering again if the control plane forgot it (404). The
registration says what the engine serves and can hold (data_plane.served_model). Each heartbeat says
whether the engine is `healthy` (its step loop alive) and `draining` (after `drain()`, called on
SIGTERM), and how much room its artifact cache has. A change of health or draining is not left for the
next interval: the client watches both (two attributes, read every WATCH_S) and beats at once, so the
control plane takes a dead or draining engine out of placement and routing within one heartbeat.

With --resolve-adapters (the default with --control-plane) the ModelResolver gets a `remote`:
GET /v1/resolve/{name}?base_model=… → the folder to load, or None. Anyone can send any `model`, so a
name reaches the control plane only if the shared name rule accepts it, quoted whole
(`quote(name, safe='')`: `../lora_stats` can never become another route), the reply is decoded into
its schema, unknown names are remembered for NEGATIVE_TTL_S (bounded), concurrent lookups of one name
share one call and at most MAX_CONCURRENT_RESOLVES run at once.

Torch-free, and it knows neither the engine's config nor its loop: what it reports comes in as `engine`
(anything with `healthy`, `dead_reason` and `stats().lora.slots_used`, as the engine has) and the
registration's fields. `register_again()` makes the next beat a registration (`loraplane agent` after
its engine restarted: a registration starts a reconcile round, which loads the engine's adapters again).

The token (LORAPLANE_CONTROL_PLANE_TOKEN: this engine's entry of the control plane's
LORAPLANE_ENGINE_CREDENTIALS) is sent only as a bearer header; it is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import quote

import httpx
import msgspec

from shared.engine_admin import EngineHeartbeat, EngineRegistration, ResolvedAdapter
from shared.names import name_problem

logger = logging.getLogger(__name__)

HEARTBEAT_S = 3.0
WATCH_S = 0.1  # how often health and draining are looked at between heartbeats
TIMEOUT_S = 5.0
NEGATIVE_TTL_S = 10.0  # an unknown name is asked about again after this long
NEGATIVE_CACHE_SIZE = 4096  # names remembered as unknown (least recently added dropped first)
MAX_CONCURRENT_RESOLVES = 4
MAX_REASON = 500


class _SlotFigures(Protocol):
    @property
    def slots_used(self) -> int: ...


class _Figures(Protocol):
    @property
    def lora(self) -> _SlotFigures: ...


class EngineState(Protocol):
    """What a heartbeat reports of the engine behind the client (data_plane.engine.protocol.EngineHealth
    has this shape; so has `loraplane agent`'s view of its engine)."""

    @property
    def healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def stats(self) -> _Figures: ...


class ControlPlaneClient:
    def __init__(self, url: str, token: str | None, *, name: str, engine_url: str, base_model: str,
                 slots_total: int, engine: EngineState | None = None, heartbeat_s: float = HEARTBEAT_S,
                 negative_ttl_s: float = NEGATIVE_TTL_S, served: Any = None,
                 registration: Mapping[str, Any] | None = None,
                 cache_bytes_free: Callable[[], int | None] | None = None) -> None:
        """served: a dataclass of further registration fields (data_plane.served_model.ServedModel);
        registration: more of them by name (`kind`, `inference_url`)."""
        self.url = url.rstrip("/")
        self.name = name
        self.engine_url = engine_url
        self.base_model = base_model
        self.slots_total = slots_total
        self.served = served  # None: only the served name is registered (a resolver alone, tests)
        self.registration = dict(registration or {})
        self._register_again = False
        self._cache_bytes_free = cache_bytes_free
        self._reported: tuple[bool, bool] | None = None  # (healthy, draining) of the last heartbeat sent
        self.heartbeat_s = heartbeat_s
        self.negative_ttl_s = negative_ttl_s
        self.draining = False
        self._engine = engine  # None: no engine behind it (a resolver alone); heartbeats say idle and healthy
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._unknown: OrderedDict[str, float] = OrderedDict()  # name -> monotonic time it expires
        self._inflight: dict[str, asyncio.Future[ResolvedAdapter | None]] = {}  # name -> the lookup under way
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_RESOLVES)

    async def start(self) -> None:
        # never follow redirects: the token must go to the control plane and nowhere else
        self._http = httpx.AsyncClient(headers=self._headers, timeout=TIMEOUT_S, follow_redirects=False)
        self._task = asyncio.create_task(self._run(), name="control-plane-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.aclose()

    # ---- resolve -------------------------------------------------------------------------------
    async def resolve(self, name: str) -> ResolvedAdapter | None:
        """Where `name`'s active version lies for this engine's base model, and its manifest digest (the
        engine refuses other content); None when not registered,
        not a valid name, recently unknown, or when the control plane cannot be asked (the request then
        gets the usual 404)."""
        if name_problem(name) is not None:
            return None
        expires = self._unknown.get(name)
        if expires is not None:
            if expires > time.monotonic():
                return None
            del self._unknown[name]
        task = self._inflight.get(name)
        if task is None:  # the first to ask; later ones share its answer. A task of its own, so that a
            # client going away cancels only its wait, not the others' answer.
            task = asyncio.ensure_future(self._ask(name))
            self._inflight[name] = task
            task.add_done_callback(lambda _: self._inflight.pop(name, None))
        return await asyncio.shield(task)

    async def _ask(self, name: str) -> ResolvedAdapter | None:
        assert self._http is not None, "start() first"
        async with self._slots:
            try:
                r = await self._http.get(f"{self.url}/v1/resolve/{quote(name, safe='')}",
                                         params={"base_model": self.base_model, "engine": self.name})
            except httpx.HTTPError as exc:
                logger.warning("control plane unreachable resolving %s: %s", name, type(exc).__name__)
                return None
        if r.status_code == 404:
            self._remember_unknown(name)
            return None
        if r.status_code != 200:
            logger.warning("control plane answered %d resolving %s", r.status_code, name)
            return None
        try:
            reply = msgspec.json.decode(r.content, type=ResolvedAdapter)
        except (msgspec.ValidationError, msgspec.DecodeError):
            logger.warning("control plane gave an invalid resolve reply for %s", name)
            return None
        if reply.name != name:
            logger.warning("control plane resolved %s as another adapter; ignored", name)
            return None
        return reply

    def _remember_unknown(self, name: str) -> None:
        self._unknown[name] = time.monotonic() + self.negative_ttl_s
        self._unknown.move_to_end(name)
        while len(self._unknown) > NEGATIVE_CACHE_SIZE:
            self._unknown.popitem(last=False)

    # ---- register, heartbeat, drain ------------------------------------------------------------
    async def drain(self) -> bool:
        """Tell the control plane this engine is going away (no new placements); later heartbeats say
        so too. True when the control plane acknowledged it."""
        self.draining = True  # the heartbeat loop notices it too (a heartbeat says so at once)
        if self._http is None:
            return False
        try:
            r = await self._http.post(f"{self.url}/v1/engines/{quote(self.name, safe='')}/drain")
        except httpx.HTTPError as exc:
            logger.warning("control plane %s unreachable for the drain: %s", self.url, type(exc).__name__)
            return False
        if r.status_code != 200:
            logger.warning("control plane answered the drain with %d", r.status_code)
            return False
        logger.info("drained at the control plane %s as %s", self.url, self.name)
        return True

    def register_again(self) -> None:
        """Register at once instead of the next heartbeat (what the engine is has changed: restarted)."""
        self._register_again = True

    async def _run(self) -> None:
        registered = False
        while True:
            if self._register_again:
                self._register_again, registered = False, False
            try:
                registered = await self._heartbeat() if registered else await self._register()
            except httpx.HTTPError as exc:
                logger.warning("control plane %s unreachable: %s", self.url, type(exc).__name__)
            await self._until_next_beat()

    def _status(self) -> tuple[bool, bool]:
        return (self._engine is None or self._engine.healthy, self.draining)

    async def _until_next_beat(self) -> None:
        """Sleep out the heartbeat interval, cut short when health or draining differ from what the
        last heartbeat said (the step loop died, or a drain began)."""
        deadline = time.monotonic() + self.heartbeat_s
        while (left := deadline - time.monotonic()) > 0:
            if self._register_again or (self._reported is not None and self._status() != self._reported):
                return
            await asyncio.sleep(min(WATCH_S, left))

    async def _register(self) -> bool:
        assert self._http is not None
        served = dataclasses.asdict(self.served) if self.served is not None else {}
        body = EngineRegistration(name=self.name, url=self.engine_url, base_model=self.base_model,
                                  slots_total=self.slots_total, **served, **self.registration)
        r = await self._http.post(f"{self.url}/v1/engines/register", content=msgspec.json.encode(body),
                                  headers={"content-type": "application/json"})
        if r.status_code != 200:
            logger.error("control plane refused the registration of %s: %d %s", self.name, r.status_code,
                         _error_message(r))
            return False
        logger.info("registered with the control plane %s as %s (%s)", self.url, self.name, self.engine_url)
        self._reported = (True, False)  # what the control plane now believes: healthy, not draining
        if self.draining:  # a re-registration makes the engine healthy there: say again that it drains
            await self._heartbeat()
        return True

    async def _heartbeat(self) -> bool:
        assert self._http is not None
        r = await self._http.post(f"{self.url}/v1/engines/{quote(self.name, safe='')}/heartbeat",
                                  content=msgspec.json.encode(self.heartbeat_body()),
                                  headers={"content-type": "application/json"})
        if r.status_code == 404:  # the control plane forgot this engine (deleted, or a fresh database)
            return await self._register()
        if r.status_code != 200:
            logger.warning("control plane answered the heartbeat with %d", r.status_code)
        return True

    def heartbeat_body(self) -> EngineHeartbeat:
        """The next heartbeat; what it says about health and draining is remembered as reported."""
        engine = self._engine
        self._reported = self._status()
        free = self._cache_bytes_free() if self._cache_bytes_free is not None else None
        if engine is None:
            return EngineHeartbeat(slots_used=0, healthy=True, draining=self.draining, reason=None,
                                   cache_bytes_free=free)
        healthy = self._reported[0]
        reason = None if healthy else (engine.dead_reason or "engine loop stopped")[:MAX_REASON]
        return EngineHeartbeat(slots_used=engine.stats().lora.slots_used, healthy=healthy,
                               draining=self.draining, reason=reason, cache_bytes_free=free)


def _error_message(r: httpx.Response) -> str:
    """The control plane's OpenAI-style error message (bounded), for the log."""
    try:
        return str(r.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return ""
