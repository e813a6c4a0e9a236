"""EngineClient: the control plane's HTTP calls to engines' LoRA admin endpoints.

One httpx.AsyncClient per app (connection pooling). Every call is bounded, because one slow or broken
engine must cost one failed call, never a stalled fleet:
- a total deadline (`deadline_s`, retries included): an engine that answers a byte every few seconds
  never resets it, as a per-read timeout would;
- a body-size cap: the reply is streamed and the call fails once it passes `max_body_bytes`;
- the reply is decoded into the typed schemas of shared.engine_admin: `[1,2,3]` is a failed call;
- only 2xx is success; redirects are never followed (a 3xx is a failure: it could point anywhere);
- connections go only to addresses the engine-URL policy allows (control_plane.egress), checked when
  connecting, so a name that resolves elsewhere after registration gets nothing, not even the token.
Connection errors, timeouts and 5xx are retried with exponential backoff within the deadline; any other
answer is final.

What the engine said is never passed on verbatim (the URL may not even be an engine): an error is the
status plus a short reason, control characters stripped (shared.sanitize). Each call is addressed to an engine by name and
URL (`EngineAt`) and carries that engine's own admin token (control_plane.engine_tokens), never the secret
it is derived from, so a URL that is no engine of ours learns nothing another engine accepts. The token
goes in the Authorization header only and is never logged; URLs in messages carry no userinfo.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple, TypeVar

import httpx
import msgspec

from control_plane.egress import REFUSED, GuardedTransport
from control_plane.engine_tokens import engine_admin_token
from shared import engine_admin
from shared.artifacts import ArtifactRef
from shared.sanitize import reply_reason, safe_url, sanitize

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
BACKOFF_S = 0.2  # 0.2 s, then 0.4 s, …
MAX_BODY_BYTES = 8 << 20  # a fleet-size /metrics or adapter listing stays far below this

T = TypeVar("T")


class EngineCallError(Exception):
    """An engine call failed for good: unreachable or too slow after the retries, an error answer, or a
    reply that is not what the endpoint returns. `message` is safe to show and store."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class EngineAt(NamedTuple):
    """An engine as it is called: its registered name (which its admin token is derived from) and URL."""

    name: str
    url: str


class EngineClient:
    def __init__(self, token_secret: str | None, deadline_s: float, *, max_attempts: int = MAX_ATTEMPTS,
                 backoff_s: float = BACKOFF_S, max_body_bytes: int = MAX_BODY_BYTES,
                 allowed_networks: tuple[str, ...] = (), transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`token_secret`: what each engine's admin token is derived from (None: engines without one);
        `allowed_networks`: the engine-URL policy, enforced on every connection (control_plane.egress);
        `transport` replaces that (tests script answers with it)."""
        self._token_secret = token_secret
        headers = {"Accept-Encoding": "identity"}  # the cap counts what is read, so nothing to inflate
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(deadline_s, connect=min(deadline_s, 5.0)),
                                       transport=transport or GuardedTransport(allowed_networks),
                                       follow_redirects=False, trust_env=False)
        self.deadline_s = deadline_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_body_bytes = max_body_bytes

    async def aclose(self) -> None:
        await self._http.aclose()

    async def load(self, engine: EngineAt, name: str, path: str | None, *, pinned: bool, load_inplace: bool,
                   artifact: ArtifactRef | None = None, deadline_s: float | None = None,
                   **extra: Any) -> engine_admin.LoadedAdapter:
        """Load from `path` (a folder the engine reads itself) or from `artifact` (the engine fetches the
        version by digest, which may take a while: `deadline_s` then replaces the client's deadline).
        `extra` fields go into the body as they are (e.g. `expected_sha256`)."""
        source: dict[str, Any] = {"lora_path": path} if artifact is None else \
            {"artifact": msgspec.to_builtins(artifact)}
        body = {"lora_name": name, **source, "pinned": pinned, "load_inplace": load_inplace, **extra}
        _, raw = await self._call("POST", engine, "/v1/load_lora_adapter", body, deadline_s=deadline_s)
        return self._decode("POST", engine.url, "/v1/load_lora_adapter", raw, engine_admin.LoadedAdapter)

    async def unload(self, engine: EngineAt, name: str) -> engine_admin.UnloadedAdapter | None:
        """Unload `name`; an engine that does not hold it (404, answered None) counts as done.

        Its requests in flight drain for up to the client's deadline, then the engine aborts them; the
        call waits for that drain on top of its own deadline, so an adapter under traffic unloads in one
        call instead of failing while the engine is still draining."""
        body = {"lora_name": name, "drain_timeout_s": self.deadline_s}
        status, raw = await self._call("POST", engine, "/v1/unload_lora_adapter", body, ok_404=True,
                                       deadline_s=2 * self.deadline_s)
        if status == 404:
            return None
        return self._decode("POST", engine.url, "/v1/unload_lora_adapter", raw, engine_admin.UnloadedAdapter)

    async def list_adapters(self, engine: EngineAt) -> engine_admin.AdapterList:
        return await self._typed("GET", engine, "/v1/lora_adapters", engine_admin.AdapterList)

    async def stats(self, engine: EngineAt) -> engine_admin.LoraStats:
        return await self._typed("GET", engine, "/v1/lora_stats", engine_admin.LoraStats)

    async def metrics(self, engine: EngineAt) -> str:
        """The engine's Prometheus exposition (text; undecodable bytes replaced)."""
        return (await self._call("GET", engine, "/metrics"))[1].decode("utf-8", errors="replace")

    async def _typed(self, method: str, engine: EngineAt, path: str, kind: type[T], body: Any = None) -> T:
        return self._decode(method, engine.url, path, (await self._call(method, engine, path, body))[1], kind)

    def _auth(self, engine: EngineAt) -> dict[str, str]:
        """The Authorization header of `engine`'s calls: its own admin token, when a secret is configured."""
        if not self._token_secret:
            return {}
        return {"Authorization": f"Bearer {engine_admin_token(self._token_secret, engine.name)}"}

    @staticmethod
    def _decode(method: str, url: str, path: str, raw: bytes, kind: type[T]) -> T:
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise EngineCallError(f"{method} {safe_url(url)}{path}: not a valid reply ({sanitize(str(exc), 120)})") \
                from None

    async def _call(self, method: str, engine: EngineAt, path: str, body: Any = None, *,
                    ok_404: bool = False, deadline_s: float | None = None) -> tuple[int, bytes]:
        where = f"{method} {safe_url(engine.url)}{path}"
        target = engine.url.rstrip("/") + path
        headers = self._auth(engine)
        deadline_s = deadline_s or self.deadline_s
        end = time.monotonic() + deadline_s
        failure = EngineCallError(f"{where}: no attempt made")
        for attempt in range(1, self.max_attempts + 1):
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    status, raw = await self._attempt(method, target, headers, body, where, deadline_s)
            except TimeoutError:
                failure = EngineCallError(f"{where}: no complete answer within {deadline_s:g} s")
                break
            except httpx.TransportError as exc:  # connect/read errors and per-read timeouts
                if str(exc).startswith(REFUSED):  # the address policy: final, and worth saying why
                    raise EngineCallError(f"{where}: {sanitize(str(exc))}") from None
                failure = EngineCallError(f"{where}: {type(exc).__name__}")
            except httpx.InvalidURL:
                raise EngineCallError(f"{where}: invalid URL") from None
            else:
                if 200 <= status < 300 or (ok_404 and status == 404):
                    return status, raw
                failure = EngineCallError(f"{where}: {reply_reason(status, raw)}", status)
                if status < 500:
                    raise failure  # the engine's answer (or a redirect): retrying would not change it
            if attempt < self.max_attempts:
                logger.debug("%s (attempt %d), retrying", failure.message, attempt)
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), max(0.0, end - time.monotonic())))
        raise failure

    async def _attempt(self, method: str, target: str, headers: dict[str, str], body: Any, where: str,
                       deadline_s: float) -> tuple[int, bytes]:
        """One request; the body streamed up to the cap."""
        too_large = EngineCallError(f"{where}: reply larger than {self.max_body_bytes} bytes")
        timeout = httpx.Timeout(deadline_s, connect=min(deadline_s, 5.0))
        async with self._http.stream(method, target, json=body, headers=headers, timeout=timeout) as r:
            if r.headers.get("content-encoding", "identity").lower() != "identity":
                # asked for identity: a compressed reply could inflate far past the cap in one chunk
                raise EngineCallError(f"{where}: compressed reply ({sanitize(r.headers['content-encoding'], 20)})")
            declared = r.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise too_large
            chunks, size = [], 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
            return r.status_code, b"".join(chunks)
