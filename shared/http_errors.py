"""Exception → HTTP response for a Litestar app, always in the OpenAI error shape; both services use it.

LoraplaneError carries its own status and body. Litestar's HTTP exceptions (unknown route, wrong
method, a body over the size limit or failing schema validation) are rewrapped; anything else is a
500 that is logged here and tells the client nothing about the server.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

from shared.errors import LoraplaneError, NotFoundError, PayloadTooLargeError
from shared.names import ADAPTER_NAME_DESCRIPTION, ADAPTER_NAME_PATTERN

logger = logging.getLogger(__name__)
CLIENT_GONE = "client disconnected prematurely"  # Litestar's words when a request body is cut off

# A schema pattern is a contract for machines; a person reading a 400 gets the rule in words.
_PATTERN_WORDS = {ADAPTER_NAME_PATTERN: f"a valid name ({ADAPTER_NAME_DESCRIPTION})"}


def readable(message: str) -> str:
    """msgspec's "Expected `str` matching regex '…'" with the rule in words, where we have them."""
    for pattern, words in _PATTERN_WORDS.items():
        message = message.replace(f"`str` matching regex {pattern!r}", words)
    return message


def error_response(exc: LoraplaneError) -> Response[dict[str, Any]]:
    return Response(exc.to_body(), status_code=exc.status_code, headers=exc.response_headers() or None)


def error_body(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response[dict[str, Any]]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}
    return Response(body, status_code=status, headers=headers)


def handle_loraplane_error(request: Request[Any, Any, Any], exc: LoraplaneError) -> Response[dict[str, Any]]:
    if exc.status_code >= 500:
        logger.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
    return error_response(exc)


def handle_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
    status = exc.status_code
    if status == 404 and not isinstance(exc, ValidationException):
        return error_response(NotFoundError(f"No route for {request.method} {request.url.path}."))
    if status == 413:
        limit = request.app.request_max_body_size
        return error_response(PayloadTooLargeError(f"The request body exceeds the limit of {limit} bytes."))
    if status == 405:
        # RFC 9110: a 405 lists the methods the resource does support (Litestar's router knows them)
        allow = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        methods = next(iter(allow.values()), "")
        return error_body(
            status, f"Method {request.method} is not allowed for {request.url.path}; allowed: {methods}.",
            headers={"Allow": methods} if methods else None,
        )
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        # msgspec names the offending field: pass it on as the OpenAI `param`
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        message = readable(f"{exc.detail}: {first.get('message', '')}".rstrip(": "))
        return error_body(status, message, param=first.get("key"))
    if status < 500:
        return error_body(status, str(exc.detail))
    if exc.detail == CLIENT_GONE:
        # the client went away while sending its body (a caller killed mid-call): nobody reads this answer,
        # and it is no server error worth a traceback
        logger.info("%s %s: the client disconnected before its request body was complete",
                    request.method, request.url.path)
        return error_body(400, "The request body ended early: the client disconnected.")
    return handle_internal_error(request, exc)


def handle_internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(LoraplaneError("Internal server error."))


def exception_handlers() -> ExceptionHandlersMap:
    return {
        LoraplaneError: handle_loraplane_error,
        HTTPException: handle_http_exception,
        Exception: handle_internal_error,
    }
