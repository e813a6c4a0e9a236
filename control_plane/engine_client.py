"""EngineClient: the control plane's HTTP calls to engines' LoRA admin endpoints.

One httpx.AsyncClient per app (connection pooling), with a timeout per call and bounded retries with
exponential backoff on what may pass (connection errors, timeouts, 5xx); a 4xx is the engine's answer
and is returned at once. The engine admin token (LORAPLANE_ENGINE_TOKEN) goes in the Authorization
header only: it is never logged, and error messages name the engine URL and status, not headers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
BACKOFF_S = 0.2  # 0.2 s, then 0.4 s, …


class EngineCallError(Exception):
    """An engine call failed for good: unreachable after the retries, or an error answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class EngineReply:
    status: int
    body: Any


class EngineClient:
    def __init__(self, token: str | None, timeout_s: float, *, max_attempts: int = MAX_ATTEMPTS,
                 backoff_s: float = BACKOFF_S, transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
                                       transport=transport)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s

    async def aclose(self) -> None:
        await self._http.aclose()

    async def load(self, url: str, name: str, path: str, *, pinned: bool, load_inplace: bool) -> Any:
        body = {"lora_name": name, "lora_path": path, "pinned": pinned, "load_inplace": load_inplace}
        return (await self._call("POST", url, "/v1/load_lora_adapter", body)).body

    async def unload(self, url: str, name: str) -> Any:
        """Unload `name`; an engine that does not hold it (404) counts as done."""
        reply = await self._call("POST", url, "/v1/unload_lora_adapter", {"lora_name": name}, ok_404=True)
        return reply.body

    async def list_adapters(self, url: str) -> Any:
        return (await self._call("GET", url, "/v1/lora_adapters")).body

    async def stats(self, url: str) -> Any:
        return (await self._call("GET", url, "/v1/lora_stats")).body

    async def metrics(self, url: str) -> str:
        """The engine's Prometheus exposition (text)."""
        return (await self._call("GET", url, "/metrics", raw=True)).body

    async def _call(self, method: str, url: str, path: str, body: Any = None, *, ok_404: bool = False,
                    raw: bool = False) -> EngineReply:
        target = url.rstrip("/") + path
        for attempt in range(1, self.max_attempts + 1):
            try:
                r = await self._http.request(method, target, json=body)
            except httpx.TransportError as exc:  # connect/read errors and timeouts
                failure = EngineCallError(f"{method} {target}: {type(exc).__name__}")
            else:
                if r.status_code < 400 or (ok_404 and r.status_code == 404):
                    return EngineReply(r.status_code, r.text if raw else _json(r))
                failure = EngineCallError(f"{method} {target}: {r.status_code} {_message(r)}", r.status_code)
                if r.status_code < 500:
                    raise failure  # the engine's answer: retrying would not change it
            if attempt < self.max_attempts:
                logger.debug("%s (attempt %d), retrying", failure.message, attempt)
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise failure


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _message(r: httpx.Response) -> str:
    """The engine's OpenAI-style error message, or the start of its body."""
    body = _json(r)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:500]
    return r.text[:200]
