"""Telling routers at once that a key was revoked or a tenant's limits changed: one Redis PUBLISH.

Best effort by design: a router that misses the message (Redis down, the router reconnecting) still
drops its cached key within its cache TTL (5 s by default), when it fetches the key's record again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.tenants import revocation_channel

logger = logging.getLogger(__name__)


class RevocationPublisher:
    def __init__(self, redis_url: str | None, prefix: str, on_publish: Callable[[str], None]) -> None:
        self.channel = revocation_channel(prefix)
        self.on_publish = on_publish  # this process's own cache hears it first
        self._client = (aioredis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
                        if redis_url else None)

    async def publish(self, event: str) -> None:
        """`key:<key id>` or `tenant:<name>`; never raises (the cache TTL is the fallback)."""
        self.on_publish(event)
        if self._client is None:
            return
        try:
            await self._client.publish(self.channel, event)
        except (RedisError, OSError) as exc:
            logger.warning("could not publish %s to Redis (%s); routers drop it within their key cache TTL",
                           event, type(exc).__name__)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
