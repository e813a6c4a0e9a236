"""The router's own failure kinds (the shared ones, 400/401/404/413/503, come from shared/errors.py; 499,
ClientDisconnected, from shared/disconnect.py)."""

from __future__ import annotations

from shared.errors import LoraplaneError, NotFoundError, OverloadedError


class NoEngineError(OverloadedError):
    """No engine could take the request (none holds the model, none could be reached); retry later."""


class UpstreamError(LoraplaneError):
    """The engine broke off its answer before the router had sent a byte of it."""

    status_code = 502
    error_type = "bad_gateway"


def model_not_found(name: str) -> NotFoundError:
    """What an engine answers for an unknown `model`, word for word: clients see one 404 either way."""
    return NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
