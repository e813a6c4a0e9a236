"""LoRA failure kinds, each with its HTTP status (see shared/errors.py)."""

from __future__ import annotations

from shared.errors import ConflictError, InvalidRequestError, NotFoundError


class LoRAAdapterError(InvalidRequestError):
    """The adapter at the given path cannot be served (files, format, shape, rank, location): the
    request's `lora_path` is what is wrong, unless the raiser names another field."""

    def __init__(self, message: str, *, param: str | None = "lora_path", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class LoRANotFoundError(NotFoundError):
    """No adapter of that name is loaded (or it is being unloaded)."""


class LoRAConflictError(ConflictError):
    """A different version of the adapter is already loaded and load_inplace was not asked for."""
