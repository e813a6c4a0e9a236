"""Exception → HTTP response for the whole control plane, always in the OpenAI error shape.

LoraplaneError carries its own status and body; Litestar's HTTP exceptions (unknown route, wrong method,
a body that fails schema validation) are rewrapped; anything else is a 500 that is logged here and tells
the client nothing about the server.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

from shared.errors import LoraplaneError, NotFoundError

logger = logging.getLogger(__name__)


def error_response(exc: LoraplaneError) -> Response[dict[str, Any]]:
    return Response(exc.to_body(), status_code=exc.status_code)


def _body(status: int, message: str, error_type: str = "invalid_request_error") -> Response[dict[str, Any]]:
    return Response({"error": {"message": message, "type": error_type, "param": None, "code": status}},
                    status_code=status)


def handle_loraplane_error(request: Request, exc: LoraplaneError) -> Response[dict[str, Any]]:
    if exc.status_code >= 500:
        logger.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
    return error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    status = exc.status_code
    if status == 404 and not isinstance(exc, ValidationException):
        return error_response(NotFoundError(f"No route for {request.method} {request.url.path}."))
    if status == 405:
        return _body(status, f"Method {request.method} is not allowed for {request.url.path}.")
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        # msgspec names the offending field; pass it on as the OpenAI `param`.
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        message = f"{exc.detail}: {first.get('message', '')}".rstrip(": ")
        body = _body(status, message)
        body.content["error"]["param"] = first.get("key")
        return body
    if status < 500:
        return _body(status, str(exc.detail))
    return handle_internal_error(request, exc)


def handle_internal_error(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(LoraplaneError("Internal server error."))


def exception_handlers() -> ExceptionHandlersMap:
    return {LoraplaneError: handle_loraplane_error, HTTPException: handle_http_exception,
            Exception: handle_internal_error}
