"""Exception → HTTP response, once for the whole app, always in the OpenAI error shape.

LoraplaneError carries its own status and body. Litestar's HTTP exceptions (unknown route, wrong
method, body over the size limit) are rewrapped; anything else is a 500 that is logged here and
reveals nothing about the server to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from shared.errors import LoraplaneError, NotFoundError, PayloadTooLargeError

logger = logging.getLogger(__name__)


class ClientDisconnected(LoraplaneError):
    """The client closed the connection before the response; nobody reads the answer."""

    status_code = 499  # nginx's "client closed request"
    error_type = "client_closed_request"


def error_response(exc: LoraplaneError) -> Response[dict[str, Any]]:
    return Response(exc.to_body(), status_code=exc.status_code)


def _error_body(status: int, message: str, error_type: str) -> Response[dict[str, Any]]:
    return Response(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}, status_code=status
    )


def handle_loraplane_error(request: Request, exc: LoraplaneError) -> Response[dict[str, Any]]:
    if exc.status_code >= 500:
        logger.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
    return error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    status = exc.status_code
    if status == 404:
        return error_response(NotFoundError(f"No route for {request.method} {request.url.path}."))
    if status == 413:
        limit = request.app.state.config.max_request_body_bytes
        return error_response(PayloadTooLargeError(f"The request body exceeds the limit of {limit} bytes."))
    if status == 405:
        return _error_body(
            status, f"Method {request.method} is not allowed for {request.url.path}.", "invalid_request_error"
        )
    if status < 500:
        return _error_body(status, str(exc.detail), "invalid_request_error")
    return handle_internal_error(request, exc)


def handle_internal_error(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(LoraplaneError("Internal server error."))


def exception_handlers() -> ExceptionHandlersMap:
    return {
        LoraplaneError: handle_loraplane_error,
        HTTPException: handle_http_exception,
        Exception: handle_internal_error,
    }
