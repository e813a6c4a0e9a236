"""The engine API's own error kinds; the exception handlers are shared (shared/http_errors.py)."""

from __future__ import annotations

from shared.errors import LoraplaneError


class ClientDisconnected(LoraplaneError):
    """The client closed the connection before the response; nobody reads the answer."""

    status_code = 499  # nginx's "client closed request"
    error_type = "client_closed_request"
