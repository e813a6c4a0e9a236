"""Forwarding a request to an engine: the body as it arrived, the answer as it comes, chunk for chunk.

A request goes to the engine's inference URL (`RouteEngine.serving_url`: its own URL, or the OpenAI
server of an engine driven by `loraplane agent`, whose `url` is the agent's admin API). `Proxy.open`
tries the candidates in the balancer's order, at most `max_attempts` of them, moving on only while
nothing of an answer exists yet: the engine refused the connection (or timed out connecting),
closed it without answering (a kept-alive connection it had dropped, or it died), answered 503
(draining, overloaded), or refused the router's own credentials (401/403: its engine key). The last
candidate's 503 reaches the client as the engine sent it; when every engine tried refused the router's
credentials, the client gets a 502 saying the router is misconfigured (EnginesRefusedError), never the
engines' words about a key it does not hold, and the router's log says which engines and how. Once an engine
has answered, `Exchange.relay` hands its answer to the client's ASGI `send`:

- `text/event-stream`: the engine's body bytes as they arrive, one ASGI message per read, never
  re-framed or parsed. An engine that breaks off mid-stream is reported as the engines report a late
  error, one `data: {"error": …}` event and `data: [DONE]`.
- anything else (JSON answers and errors): read whole, then sent with the engine's status; an engine that
  breaks off first is a 502 (UpstreamError, raised: no byte has reached the client yet).

A client that goes away cancels the relay (service.py races it against the ASGI disconnect); closing the
engine's response then closes its connection, which the engine takes as an abort.

Every answer of an engine carries `x-loraplane-engine: <its name>`. One pooled aiohttp session (its C
HTTP parser: a fraction of httpx's CPU per request, docs/performance.md#router-and-fleet) serves all
requests; the engines' inference key (`Authorization: Bearer`) is the only credential sent, never the
client's, and only to engines the routing table marks as registered with their own credential (not to one
an admin token registered at some URL); no cookie is kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from multidict import CIMultiDict
from yarl import URL

from data_plane.router.balancer import Balancer, Candidate
from data_plane.router.errors import EnginesRefusedError, NoEngineError, UpstreamError
from data_plane.router.metrics import RouterMetrics
from data_plane.router.usage import UsageTap
from shared.routes import RouteEngine

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
ENGINE_HEADER = "x-loraplane-engine"
_SSE = "text/event-stream"
DONE = b"data: [DONE]\n\n"  # a stream's end as clients read it
# what a retry may follow: nothing of an answer exists yet (checked in this order: subclasses first)
_RETRY_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (aiohttp.ClientConnectorError, "connect"), (aiohttp.ConnectionTimeoutError, "connect"),
    (aiohttp.ServerDisconnectedError, "disconnected"),
)
_RETRYABLE = tuple(kind for kind, _ in _RETRY_ERRORS)
# anything else an engine's connection can raise: no answer within the read timeout, a reset, a body cut off
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
_MAX_URLS = 4096  # parsed engine URLs kept (two paths per engine)
_REFUSED = (401, 403)  # an engine refused the router's credentials: the next one is tried
REFUSED_LOG_S = 10.0  # an engine's refusals are logged at most this often
_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


# An idle pooled connection is dropped after this long, before the engine's own idle bound (uvicorn's
# timeout_keep_alive, 5 s) closes it: reusing a connection the engine is closing loses the request with a
# reset that the router cannot tell from a request the engine took (aiohttp's default keeps them 15 s)
ENGINE_KEEPALIVE_S = 4.0


def engine_session(*, connect_timeout_s: float, read_timeout_s: float, max_connections: int) -> aiohttp.ClientSession:
    """The pooled session to all engines (created on the running loop, at the router's start). No total
    timeout: a stream lasts as long as its generation; `read_timeout_s` bounds the wait for each next byte."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0,
                                       keepalive_timeout=ENGINE_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),  # an engine's cookie must never reach another tenant's request
        auto_decompress=False,  # bytes pass through as the engine sent them
        skip_auto_headers=("Accept-Encoding",),  # … so engines are never asked to compress
        raise_for_status=False,
    )


@dataclass
class Exchange:
    """One request in flight at one engine: counted by the balancer until `close`."""

    candidate: Candidate
    model: str
    response: aiohttp.ClientResponse
    sent_at: float
    proxy: Proxy
    extra_headers: Sequence[tuple[bytes, bytes]] = ()  # e.g. a tenant key's x-ratelimit-* headers
    tap: UsageTap | None = None  # reads the answer's token usage (tenant keys' quotas)
    _open: bool = field(default=True)

    @property
    def engine(self) -> str:
        return self.candidate.engine.name

    @property
    def status(self) -> int:
        return self.response.status

    def first_byte(self) -> None:
        self.proxy.metrics.ttft.labels(self.engine).observe(time.perf_counter() - self.sent_at)

    def close(self, outcome: str) -> None:
        """Count the request as finished (once), then let go of the engine's response: a connection read to
        its end goes back to the pool; any other is closed, which aborts the engine's request."""
        if self._open:
            self._open = False
            self.proxy.balancer.end(self.engine, self.model)
            self.proxy.metrics.request(self.model, self.engine, outcome)
        if self.response.content.is_eof():
            self.response.release()
        else:
            self.response.close()

    async def relay(self, send: Send) -> None:
        """Send the engine's answer to the client (see the module docstring); closes the exchange."""
        try:
            if self.response.content_type == _SSE:
                await self._stream(send)
            else:
                await self._whole(send)
        finally:
            self.close("abort")  # a no-op for the count once an outcome was recorded

    def _headers(self, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        content_type = self.response.headers.get("Content-Type", "application/json")
        return [(b"content-type", content_type.encode("latin-1")), (ENGINE_HEADER.encode(), self.engine.encode()),
                *self.extra_headers, *extra]

    async def _whole(self, send: Send) -> None:
        self.first_byte()
        try:
            body = await self.response.read()
        except _UPSTREAM_ERRORS as exc:
            self.close("error")
            logger.warning("engine %s broke off its answer: %s: %s", self.engine, type(exc).__name__, exc)
            raise UpstreamError(f"The engine `{self.engine}` broke off its answer; retry.") from None
        self.close("ok" if self.status < 400 else "error")
        if self.tap is not None:
            self.tap.whole(body)
        await send({"type": "http.response.start", "status": self.status,
                    "headers": self._headers((b"content-length", str(len(body)).encode()))})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self._headers(*_STREAM_HEADERS)})
        outcome, tail, first = "abort", b"\n\n", True
        try:
            async for chunk in self.response.content.iter_any():
                if first:
                    self.first_byte()
                    first = False
                if self.tap is not None and not (chunk := self.tap.feed(chunk)):
                    continue  # held back (a usage event the client did not ask for, or part of one)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = chunk[-2:]
            outcome = "ok" if self.status < 400 else "error"
            last = self.tap.flush() if self.tap is not None else b""
        except _UPSTREAM_ERRORS as exc:
            outcome = "error"
            logger.warning("engine %s broke off its stream: %s: %s", self.engine, type(exc).__name__, exc)
            last = (b"" if tail == b"\n\n" else b"\n\n") + _late_error(self.engine) + DONE
        self.close(outcome)
        await send({"type": "http.response.body", "body": last})


class Proxy:
    def __init__(self, balancer: Balancer, metrics: RouterMetrics, *, engine_api_key: str | None,
                 max_attempts: int) -> None:
        self.session: aiohttp.ClientSession | None = None  # set by the service's start (needs a running loop)
        self.balancer = balancer
        self.metrics = metrics
        self.max_attempts = max_attempts
        # built once: aiohttp would otherwise parse the URL and copy the headers on every request
        self._plain = CIMultiDict({"Content-Type": "application/json"})
        # the engines' key goes only to engines registered with their own credential (the table says so)
        self._keyed = self._plain.copy()
        if engine_api_key:
            self._keyed["Authorization"] = f"Bearer {engine_api_key}"
        self._urls: dict[tuple[str, str], URL] = {}
        self._refused_logged: dict[str, float] = {}  # engine -> when its refusal was last logged

    async def forward(self, candidates: list[Candidate], path: str, body: bytes, model: str, send: Send, *,
                      kind: str, affinity: int | None, headers: Sequence[tuple[bytes, bytes]] = (),
                      tap: UsageTap | None = None) -> None:
        """Relay the answer of the first candidate that answers; `kind` (base, adapter) says which affinity
        the choice is counted for, and the engine that answers is remembered for `affinity` (balancer.py).
        `headers` go on the answer; `tap` sees its body as it passes (usage.py)."""
        exchange = await self._open(candidates, path, body, model)
        exchange.extra_headers, exchange.tap = headers, tap
        if kind == "adapter":
            self.metrics.affinity.labels("hit" if exchange.candidate.residency == "device" else "miss").inc()
        elif affinity is not None:
            self.metrics.prefix_affinity.labels("hit" if exchange.candidate.preferred else "miss").inc()
        if exchange.status < 400:
            self.balancer.served(affinity, exchange.engine)
        await exchange.relay(send)

    async def _open(self, candidates: list[Candidate], path: str, body: bytes, model: str) -> Exchange:
        assert self.session is not None, "the router has not started"
        tries = candidates[: self.max_attempts]
        reason = None
        refused = 0
        for i, candidate in enumerate(tries):
            if reason is not None:
                self.metrics.retries.labels(reason).inc()
            name = candidate.engine.name
            self.balancer.begin(name, model)
            sent_at = time.perf_counter()
            try:
                response = await self.session.post(self._url(candidate.engine.serving_url, path), data=body,
                                                   headers=self._headers_for(candidate.engine))
            except _RETRYABLE as exc:
                self.balancer.end(name, model)
                reason = next(r for kind, r in _RETRY_ERRORS if isinstance(exc, kind))
                if reason == "connect":
                    self.balancer.mark_down(name)
                logger.warning("engine %s (%s) failed before answering: %s: %s", name, candidate.engine.serving_url,
                               type(exc).__name__, exc)
                continue
            except _UPSTREAM_ERRORS as exc:  # e.g. no answer within the read timeout: no retry doubles the load
                self.balancer.end(name, model)
                self.metrics.request(model, name, "error")
                logger.warning("engine %s did not answer: %s: %s", name, type(exc).__name__, exc)
                raise UpstreamError(f"The engine `{name}` did not answer; retry.") from None
            except BaseException as exc:  # cancelled (the client left), or an error no retry follows
                self.balancer.end(name, model)
                self.metrics.request(model, name, "abort" if isinstance(exc, asyncio.CancelledError) else "error")
                raise
            exchange = Exchange(candidate, model, response, sent_at, self)
            if response.status in _REFUSED:  # the router's own key: no client may see the engine's words
                exchange.close("refused")
                refused += 1
                reason = "refused"
                self._refused(candidate.engine, response.status)
                continue
            if response.status == 503 and i + 1 < len(tries):
                exchange.close("error")
                reason = "unavailable"
                continue
            return exchange
        self.metrics.request(model, "", "unavailable")
        if refused:
            raise EnginesRefusedError(len(tries))
        raise NoEngineError(f"No engine holding `{model}` could be reached ({len(tries)} tried); retry later.")

    def _headers_for(self, engine: RouteEngine) -> CIMultiDict[str]:
        return self._plain if engine.credentialed is False else self._keyed

    def _refused(self, engine: RouteEngine, status: int) -> None:
        """Tell the operator (at most every REFUSED_LOG_S per engine) what the client is not told."""
        now = time.monotonic()
        if now - self._refused_logged.get(engine.name, -REFUSED_LOG_S) < REFUSED_LOG_S:
            return
        if len(self._refused_logged) >= _MAX_URLS:
            self._refused_logged.clear()
        self._refused_logged[engine.name] = now
        if engine.credentialed is False:
            fix = ("it was registered with an admin token, not its own engine credential, so the router sends "
                   "it no key: let the engine register itself (LORAPLANE_CONTROL_PLANE_TOKEN)")
        elif "Authorization" in self._keyed:
            fix = ("the router's LORAPLANE_ENGINE_API_KEY is not its --api-key: give the router the engines' key "
                   "(under `loraplane up`: .loraplane/engine-api-key)")
        else:
            fix = ("the router has no LORAPLANE_ENGINE_API_KEY: give it the engines' --api-key (under `loraplane "
                   "up`: .loraplane/engine-api-key)")
        logger.error("engine %s (%s) answered %d to the router's credentials: the router is misconfigured; %s. "
                     "Requests that no engine accepts are answered 502 and cost no quota.",
                     engine.name, engine.serving_url, status, fix)

    def _url(self, engine_url: str, path: str) -> URL:
        url = self._urls.get((engine_url, path))
        if url is None:
            if len(self._urls) >= _MAX_URLS:  # engines come and go: forget them all now and then
                self._urls.clear()
            url = self._urls[(engine_url, path)] = URL(engine_url + path)
        return url


def _late_error(engine: str) -> bytes:
    error = UpstreamError(f"The engine `{engine}` broke off the stream.")
    return b"data: " + msgspec.json.encode(error.to_body()) + b"\n\n"
