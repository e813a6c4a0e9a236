"""LoRA failure kinds, each with its HTTP status (see shared/errors.py)."""

from __future__ import annotations

from shared.errors import ConflictError, NotFoundError
from shared.peft import AdapterFilesError

# The adapter at the given path cannot be served: one error kind, shared with the control plane.
LoRAAdapterError = AdapterFilesError


class LoRANotFoundError(NotFoundError):
    """No adapter of that name is loaded (or it is being unloaded)."""


class LoRAConflictError(ConflictError):
    """A different version of the adapter is already loaded and load_inplace was not asked for."""
