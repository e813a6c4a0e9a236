"""Schemathesis hooks for the engine contract run (loaded through `hooks` in engine.toml).

Random `model` strings are all 404s (a documented answer, but it stops every case before sampling,
tokenizing or streaming ever run). So most generated bodies get a model this engine serves instead:
the base model or the preloaded adapter. Likewise random `lora_path`s are all outside the engine's
--lora-roots; half of them become the demo adapter's folder, so loads run too. Only string values
are replaced: a negative case that made the field a wrong type stays negative.
"""

from __future__ import annotations

import os
import random

import schemathesis

import tests.contracts.no_target_phase  # noqa: F401 (a workaround, applied on import)

SERVED = [name for name in os.environ.get("CONTRACT_MODELS", "").split(",") if name]
ADAPTER_PATH = os.environ.get("CONTRACT_ADAPTER_PATH")
_rng = random.Random(0)


@schemathesis.hook
def map_body(ctx, body):
    # a non-empty model only: an empty one may be what makes a negative case negative (the router's minLength)
    if SERVED and isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] \
            and _rng.random() < 0.85:
        body["model"] = _rng.choice(SERVED)
    if ADAPTER_PATH and isinstance(body, dict) and _valid_path(body.get("lora_path")) and _rng.random() < 0.5:
        body["lora_path"] = ADAPTER_PATH
    return body


def _valid_path(value: object) -> bool:
    """What the schema admits as `lora_path` (1-4096 characters, no NUL): a negative case that broke
    that rule must keep its bad path, or the engine would rightly accept it."""
    return isinstance(value, str) and 1 <= len(value) <= 4096 and "\x00" not in value
