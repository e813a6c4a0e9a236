"""Which engines serve an adapter's base model (issue 11, §1).

An adapter names its base model as the operator gave it, or as its adapter_config.json's
`base_model_name_or_path` says: often a hub id (`meta-llama/Llama-3.2-1B`) or the local path the adapter
was trained against, rarely the name an engine serves the base under. So an engine matches when the
adapter's base model equals any of what the engine registered:

- its served name (`Engine.base_model`, what clients send as `model`);
- its checkpoint's `_name_or_path` (config.json);
- its model path (the folder it loaded);
- the sha256 hex digest of its config.json (optionally written `sha256:<hex>`).

Paths and ids are compared without trailing slashes (`/models/llama/` is `/models/llama`). One SQL
clause, so callers filter engines set-wise (the planner, the routes table) instead of per row in Python.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, or_

from control_plane.db.models import Engine

_DIGEST_PREFIX = "sha256:"


def normalise(name: str) -> str:
    """A base-model name or path as compared: surrounding whitespace and trailing slashes stripped
    (a lone `/` stays itself)."""
    stripped = name.strip()
    return stripped.rstrip("/") or stripped


def serves_base_model(base: str) -> ColumnElement[bool]:
    """True for the engines whose served name, `_name_or_path`, model path or config digest is `base`."""
    wanted = normalise(base)
    digest = wanted.removeprefix(_DIGEST_PREFIX).lower()
    return or_(
        Engine.base_model == base,
        Engine.base_model == wanted,
        func.rtrim(Engine.model_name_or_path, "/") == wanted,
        func.rtrim(Engine.model_path, "/") == wanted,
        Engine.config_digest == digest,
    )
