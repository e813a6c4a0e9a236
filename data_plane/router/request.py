"""What the router reads of a request: the client's key, and `model`, `stream` and the prompt's first bytes.

The body is decoded once, by msgspec, into `RequestHead` (every other field is skipped, not built), and
forwarded to the engine as the bytes that arrived: the router never re-encodes a request.
"""

from __future__ import annotations

import hmac

import msgspec

from shared.errors import AuthenticationError, InvalidRequestError

_ABSENT = msgspec.Raw(b"")  # a Raw field cannot be optional in a union; an empty one means absent


class RequestHead(msgspec.Struct):
    model: str
    stream: bool = False
    prompt: msgspec.Raw = _ABSENT  # /v1/completions; kept undecoded (only its first bytes are read)
    messages: msgspec.Raw = _ABSENT  # /v1/chat/completions


_decoder = msgspec.json.Decoder(RequestHead)


def parse_head(body: bytes) -> RequestHead:
    """The fields routing needs; InvalidRequestError (400, `param` naming the field) when they are bad."""
    try:
        head = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = "stream" if "$.stream" in message else "model" if "model" in message else None
        raise InvalidRequestError(f"Invalid request body: {message}", param=param) from None
    except msgspec.DecodeError:
        raise InvalidRequestError("The request body is not valid JSON.") from None
    if not head.model:
        raise InvalidRequestError("`model` must not be empty.", param="model")
    return head


def check_required(head: RequestHead, path: str) -> None:
    """400 naming the field for a completion without `prompt` or a chat without `messages` (as the engines
    answer it, and as the router's document says), before any routing or quota work."""
    chat = path.endswith("/chat/completions")
    if not len(head.messages if chat else head.prompt):
        field = "messages" if chat else "prompt"
        raise InvalidRequestError(f"`{field}` is required.", param=field)


def prefix_key(head: RequestHead, chars: int) -> int | None:
    """A hash of the model and the first `chars` bytes of the prompt (or of the messages) as the client
    sent them, or None without one: requests whose prompts start alike share the engine's prefix cache
    when routed alike. A collision only costs a cache miss, so the process-salted built-in hash is enough."""
    raw = memoryview(head.messages if len(head.messages) else head.prompt)
    if not len(raw):
        return None
    return hash((head.model, bytes(raw[:chars])))


def adapter_key(model: str) -> int:
    """The affinity key of an adapter's requests (one per adapter: the balancer sends them where the last
    went). Hashed apart from the prompt prefix keys, which hash a (model, bytes) pair."""
    return hash(("adapter", model))


def check_client_key(authorization: str | None, keys: frozenset[str]) -> None:
    """No keys configured → open. Otherwise `Authorization: Bearer <key>` with one of them, compared in
    constant time with each; 401 in OpenAI's shape otherwise. The key itself is never forwarded."""
    if not keys:
        return
    scheme, _, offered = (authorization or "").strip().partition(" ")
    offered_bytes = offered.strip().encode()
    matched = False
    for key in keys:  # no early exit: the time taken does not tell which key came close
        matched |= hmac.compare_digest(offered_bytes, key.encode())
    if scheme.lower() != "bearer" or not matched:
        raise AuthenticationError(
            "Missing or incorrect API key: send `Authorization: Bearer <key>` (one of the router's "
            "LORAPLANE_API_KEYS).",
            code="invalid_api_key",
        )
