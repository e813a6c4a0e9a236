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


class EnginesRefusedError(UpstreamError):
    """Every engine tried refused the router's own credentials (401/403): the router is misconfigured. The
    engines' words are not passed on: they name the engine's key, which the client does not hold."""

    def __init__(self, tried: int) -> None:
        super().__init__(f"No engine accepted the request: the {tried} engine(s) tried refused the router's own "
                         "credentials, so the router is misconfigured. Your key was not at fault and the request "
                         "was not charged; tell the router's operator (its log names the engines and the fix): "
                         "a retry will not help until then.",
                         code="router_misconfigured")


# what ends a request before any engine accepted it: a tenant's quotas are given back
UNSERVED: tuple[type[LoraplaneError], ...] = (NoEngineError, EnginesRefusedError, NotFoundError)


def model_not_found(name: str) -> NotFoundError:
    """What an engine answers for an unknown `model`, word for word: clients see one 404 either way."""
    return NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
