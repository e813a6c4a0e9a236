"""Schemathesis hooks for the control plane's contract run (loaded through `hooks` in control_plane.toml).

Random `lora_path`s all lie outside the adapter roots (a semantic 400 that stops every load before
the registry or a push is reached). So half of the schema-valid ones become a demo adapter's folder,
with `base_model` the one the run's registered engine serves: those loads are recorded and pushed to
that engine, which is absent (a 502 with the AdapterLoaded body; 207 when another engine took it).
Only schema-valid values are replaced: a negative case keeps what made it negative.
"""

from __future__ import annotations

import os
import random

import schemathesis

import tests.contracts.no_target_phase  # noqa: F401 (a workaround, applied on import)

ADAPTER_PATHS = [p for p in os.environ.get("CONTRACT_ADAPTER_PATHS", "").split(os.pathsep) if p]
BASE_MODEL = os.environ.get("CONTRACT_BASE_MODEL", "demo")
_rng = random.Random(0)


@schemathesis.hook
def map_body(ctx, body):
    if (ADAPTER_PATHS and isinstance(body, dict) and _valid_path(body.get("lora_path"))
            and _valid_base_model(body.get("base_model")) and _rng.random() < 0.5):
        body["lora_path"] = _rng.choice(ADAPTER_PATHS)
        body["base_model"] = BASE_MODEL
    return body


def _valid_path(value: object) -> bool:
    """What the schema admits as `lora_path` (1-1024 characters, no NUL)."""
    return isinstance(value, str) and 1 <= len(value) <= 1024 and "\x00" not in value


def _valid_base_model(value: object) -> bool:
    """What the schema admits as `base_model` (absent, null, or 1-256 characters): a negative case whose
    invalid part is its base_model must keep it (replaced, the load was valid and answered 200, which
    Schemathesis reported as a schema-violating request accepted)."""
    return value is None or (isinstance(value, str) and 1 <= len(value) <= 256)
