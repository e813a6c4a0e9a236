"""One error type per failure kind, each mapped once to an HTTP status and an OpenAI-style body."""

from __future__ import annotations

import math
from typing import Any


class LoraplaneError(Exception):
    """Base class: `status_code` and `error_type` drive the OpenAI-style JSON error body."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status_code,
            }
        }

    def response_headers(self) -> dict[str, str]:
        """Headers the answer carries besides the body (none but where a subclass says)."""
        return {}


class InvalidRequestError(LoraplaneError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(LoraplaneError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(LoraplaneError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(LoraplaneError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(LoraplaneError):
    status_code = 409
    error_type = "conflict_error"


class RequestTimeoutError(LoraplaneError):
    """408: the client stopped sending its request's body."""

    status_code = 408
    error_type = "invalid_request_error"


class PayloadTooLargeError(LoraplaneError):
    status_code = 413
    error_type = "invalid_request_error"


class RateLimitError(LoraplaneError):
    """429 in OpenAI's shape (`type` requests, `code` rate_limit_exceeded) with Retry-After."""

    status_code = 429
    error_type = "requests"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s

    def response_headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class OverloadedError(LoraplaneError):
    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(LoraplaneError):
    status_code = 503
    error_type = "engine_dead"


class UnsupportedModelError(LoraplaneError):
    """The checkpoint cannot be served (architecture, tensors, files)."""

    status_code = 400
    error_type = "invalid_request_error"
