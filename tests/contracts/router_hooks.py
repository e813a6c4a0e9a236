"""Schemathesis hooks of the router's contract run (loaded through `hooks` in router.toml).

The engine's hooks (tests.contracts.hooks) give most generated bodies a model the fleet serves. And one
check of the router's own: router.toml accepts a 400 to schema-valid data, because the engine behind the
router refuses some of it for reasons no schema states (a prompt longer than its context). An answer of
an engine carries x-loraplane-engine; a 400 without it is the router's own refusal of a request its
document admits, which is a contract violation all the same.
"""

from __future__ import annotations

import schemathesis

import tests.contracts.hooks  # noqa: F401 (its map_body hook, registered on import)

ENGINE_HEADER = "x-loraplane-engine"


@schemathesis.check
def router_accepts_what_it_documents(ctx, response, case):  # noqa: ANN001, ANN201
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if response.status_code == 400 and ENGINE_HEADER not in response.headers:
        raise AssertionError(f"The router itself answered 400 to a request its document admits: {response.text[:300]}")
    return None
