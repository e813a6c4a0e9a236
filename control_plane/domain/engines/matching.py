"""Which engines serve an adapter's base model.

An adapter names its base model as the operator gave it, or as its adapter_config.json's
`base_model_name_or_path` says: often a hub id (`meta-llama/Llama-3.2-1B`) or the local path the adapter
was trained against, rarely the name an engine serves the base under. So an engine matches when the
adapter's base model equals any of what the engine registered:

- its served name (`Engine.base_model`, what clients send as `model`);
- its checkpoint's `_name_or_path` (config.json);
- its model path (the folder it loaded);
- the sha256 hex digest of its config.json (optionally written `sha256:<hex>`);
- for a relative path of two or more segments (`.demo/model`, `./models/llama`; no `..`): a model path
  or `_name_or_path` that ends with it, as the path resolves from the folder the model lies under
  (`/srv/loraplane/.demo/model`).

Paths and ids are compared without trailing slashes (`/models/llama/` is `/models/llama`). One SQL
clause, so callers filter engines set-wise (the planner) instead of per row in Python; `engine_serves`
is the same rule for engine rows already in memory (the routes table), and a test holds the two equal.
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


def _digest(wanted: str) -> str:
    return wanted.removeprefix(_DIGEST_PREFIX).lower()


def relative_tail(wanted: str) -> str | None:
    """`/` + a relative path of two or more segments (without a leading `./`), as an absolute path
    that it resolves to ends; None for anything else (an absolute path, a URL, a single name, `..`)."""
    path = wanted
    while path.startswith("./"):
        path = path[2:]
    segments = path.split("/")
    if (wanted.startswith("/") or "://" in wanted or len(segments) < 2
            or any(s in ("", ".", "..") for s in segments)):
        return None
    return "/" + path


def serves_base_model(base: str) -> ColumnElement[bool]:
    """True for the engines whose served name, `_name_or_path`, model path or config digest is `base`."""
    wanted = normalise(base)
    tail = relative_tail(wanted)
    tails = [] if tail is None else [func.rtrim(Engine.model_path, "/").endswith(tail, autoescape=True),
                                     func.rtrim(Engine.model_name_or_path, "/").endswith(tail, autoescape=True)]
    return or_(
        Engine.base_model == base,
        Engine.base_model == wanted,
        func.rtrim(Engine.model_name_or_path, "/") == wanted,
        func.rtrim(Engine.model_path, "/") == wanted,
        Engine.config_digest == _digest(wanted),
        *tails,
    )


def engine_serves(engine: Engine, base: str) -> bool:
    """`serves_base_model` for an engine row in memory."""
    wanted = normalise(base)
    tail = relative_tail(wanted)
    paths = [p.rstrip("/") for p in (engine.model_name_or_path, engine.model_path) if p is not None]
    return (engine.base_model in (base, wanted) or wanted in paths
            or (tail is not None and any(p.endswith(tail) for p in paths))
            or (engine.config_digest is not None and engine.config_digest == _digest(wanted)))
