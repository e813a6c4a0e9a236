"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end.

An error after the response has started cannot change the status any more; like the OpenAI API,
it is sent as one `data: {"error": {...}}` event before [DONE].
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.errors import LoraplaneError

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


@dataclass
class EventStream:
    """A streamed response body plus how to end the generation behind it. The HTTP layer calls
    `aclose()` once the response is over, whether it completed, failed or the client went away."""

    body: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]

    async def aclose(self) -> None:
        await self.body.aclose()
        await self.close()  # the body may never have started, so its own cleanup may not have run


def event_stream(chunks: AsyncIterator[dict[str, Any]], close: Callable[[], Awaitable[None]]) -> EventStream:
    return EventStream(_sse_body(chunks, close), close)


async def _sse_body(
    chunks: AsyncIterator[dict[str, Any]], close: Callable[[], Awaitable[None]]
) -> AsyncGenerator[bytes, None]:
    try:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except LoraplaneError as exc:
            yield sse(exc.to_body())
        except Exception:
            logger.exception("error while streaming a response")
            yield sse(LoraplaneError("Internal server error.").to_body())  # no internals to the client
        yield SSE_DONE
    finally:
        await close()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
