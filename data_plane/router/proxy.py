"""Forwarding a request to an engine: the body as it arrived, the answer as it comes, chunk for chunk.

`Proxy.forward` tries the candidates in the balancer's order, at most `max_attempts` of them, moving on
only while nothing of an answer exists yet: the engine refused the connection (or timed out connecting),
closed it without answering (a kept-alive connection it had dropped, or it died), or answered 503
(draining, overloaded). The last candidate's 503 reaches the client as the engine sent it. Once an engine
has answered, its answer is the client's:

- `text/event-stream`: a Litestar Stream of the engine's raw chunks, unbuffered. An engine that breaks
  off mid-stream is reported as the engines report a late error, one `data: {"error": …}` event and
  `data: [DONE]`. A client that goes away cancels the stream; closing the engine's response then closes
  its connection, which the engine takes as an abort.
- anything else (JSON answers and errors): read whole, then sent with the engine's status; an engine that
  breaks off first is a 502, since no byte has reached the client yet.

Every answer of an engine carries `x-loraplane-engine: <its name>`. One pooled httpx client serves all
requests; the engines' inference key (`Authorization: Bearer`) is the only credential sent, never the
client's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import msgspec
from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from data_plane.router.balancer import Balancer, Candidate
from data_plane.router.errors import NoEngineError, UpstreamError
from data_plane.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

ENGINE_HEADER = "x-loraplane-engine"
_SSE = "text/event-stream"
_DONE = b"data: [DONE]\n\n"
# what a retry may follow: nothing of an answer exists yet
_RETRY_ERRORS: dict[type[httpx.HTTPError], str] = {
    httpx.ConnectError: "connect", httpx.ConnectTimeout: "connect", httpx.RemoteProtocolError: "disconnected",
}


@dataclass
class Exchange:
    """One request in flight at one engine: counted by the balancer until `close`."""

    candidate: Candidate
    model: str
    response: httpx.Response
    sent_at: float
    proxy: Proxy
    _open: bool = field(default=True)

    @property
    def engine(self) -> str:
        return self.candidate.engine.name

    def first_byte(self) -> None:
        self.proxy.metrics.ttft.labels(self.engine).observe(time.perf_counter() - self.sent_at)

    async def close(self, outcome: str) -> None:
        """Count the request as finished (once), then close the engine's response (a no-op if read whole;
        otherwise its connection is closed, which aborts the engine's request)."""
        if self._open:
            self._open = False
            self.proxy.balancer.end(self.engine, self.model)
            self.proxy.metrics.request(self.model, self.engine, outcome)
        await self.response.aclose()


class Proxy:
    def __init__(self, client: httpx.AsyncClient, balancer: Balancer, metrics: RouterMetrics, *,
                 engine_api_key: str | None, max_attempts: int) -> None:
        self.client = client
        self.balancer = balancer
        self.metrics = metrics
        self.max_attempts = max_attempts
        self._headers = {"Content-Type": "application/json"}
        if engine_api_key:
            self._headers["Authorization"] = f"Bearer {engine_api_key}"

    async def forward(self, candidates: list[Candidate], path: str, body: bytes, model: str, *, kind: str,
                      prefix: int | None) -> Response:
        """The answer of the first candidate that answers; `kind` (base, adapter) and `prefix` (the prompt
        prefix key of a base-model request) say which affinity the choice is counted for."""
        exchange = await self._open(candidates, path, body, model)
        if kind == "adapter":
            self.metrics.affinity.labels("hit" if exchange.candidate.residency == "device" else "miss").inc()
        elif prefix is not None:
            self.metrics.prefix_affinity.labels("hit" if exchange.candidate.preferred else "miss").inc()
            if exchange.response.status_code < 400:
                self.balancer.served(prefix, exchange.engine)
        if exchange.response.headers.get("content-type", "").startswith(_SSE):
            return self._stream(exchange)
        return await self._whole(exchange)

    async def _open(self, candidates: list[Candidate], path: str, body: bytes, model: str) -> Exchange:
        tries = candidates[: self.max_attempts]
        reason = None
        for i, candidate in enumerate(tries):
            if reason is not None:
                self.metrics.retries.labels(reason).inc()
            name = candidate.engine.name
            request = self.client.build_request("POST", candidate.engine.url + path, content=body,
                                                headers=self._headers)
            self.balancer.begin(name, model)
            sent_at = time.perf_counter()
            try:
                response = await self.client.send(request, stream=True)
            except tuple(_RETRY_ERRORS) as exc:
                self.balancer.end(name, model)
                reason = next(r for kind, r in _RETRY_ERRORS.items() if isinstance(exc, kind))
                if reason == "connect":
                    self.balancer.mark_down(name)
                logger.warning("engine %s (%s) failed before answering: %s: %s", name, candidate.engine.url,
                               type(exc).__name__, exc)
                continue
            except httpx.HTTPError as exc:  # e.g. no answer within the read timeout: no retry doubles the load
                self.balancer.end(name, model)
                self.metrics.request(model, name, "error")
                logger.warning("engine %s did not answer: %s: %s", name, type(exc).__name__, exc)
                raise UpstreamError(f"The engine `{name}` did not answer; retry.") from None
            except BaseException as exc:  # cancelled (the client left), or an error no retry follows
                self.balancer.end(name, model)
                self.metrics.request(model, name, "abort" if isinstance(exc, asyncio.CancelledError) else "error")
                raise
            exchange = Exchange(candidate, model, response, sent_at, self)
            if response.status_code == 503 and i + 1 < len(tries):
                await exchange.close("error")
                reason = "unavailable"
                continue
            return exchange
        self.metrics.request(model, "", "unavailable")
        raise NoEngineError(f"No engine holding `{model}` could be reached ({len(tries)} tried); retry later.")

    async def _whole(self, exchange: Exchange) -> Response:
        response, chunks = exchange.response, []
        try:
            async for chunk in response.aiter_raw():
                if not chunks:
                    exchange.first_byte()
                chunks.append(chunk)
        except httpx.HTTPError as exc:
            await exchange.close("error")
            logger.warning("engine %s broke off its answer: %s: %s", exchange.engine, type(exc).__name__, exc)
            raise UpstreamError(f"The engine `{exchange.engine}` broke off its answer; retry.") from None
        except BaseException:
            await exchange.close("abort")
            raise
        await exchange.close("ok" if response.status_code < 400 else "error")
        return Response(b"".join(chunks), status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"),
                        headers={ENGINE_HEADER: exchange.engine})

    def _stream(self, exchange: Exchange) -> Stream:
        async def body():  # noqa: ANN202 (an async generator of bytes)
            outcome, tail = "abort", b"\n\n"
            try:
                first = True
                async for chunk in exchange.response.aiter_raw():
                    if first:
                        exchange.first_byte()
                        first = False
                    yield chunk
                    tail = chunk[-2:]
                outcome = "ok" if exchange.response.status_code < 400 else "error"
            except httpx.HTTPError as exc:
                outcome = "error"
                logger.warning("engine %s broke off its stream: %s: %s", exchange.engine, type(exc).__name__, exc)
                yield (b"" if tail == b"\n\n" else b"\n\n") + _late_error(exchange.engine) + _DONE
            finally:
                await exchange.close(outcome)

        return Stream(body(), status_code=exchange.response.status_code, media_type=_SSE,
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", ENGINE_HEADER: exchange.engine},
                      background=BackgroundTask(exchange.close, "abort"))  # runs however the stream ended


def _late_error(engine: str) -> bytes:
    error = UpstreamError(f"The engine `{engine}` broke off the stream.")
    return b"data: " + msgspec.json.encode(error.to_body()) + b"\n\n"
