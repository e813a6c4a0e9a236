"""Real `loraplane engine --enable-lora` processes for the control-plane tests that push to engines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine

ENGINE_TOKEN = "engine-token-for-tests"


@contextlib.contextmanager
def lora_engine(base: Path, adapter_root: Path, log: Path, *flags: str) -> Iterator[EngineServer]:
    """An engine serving the demo model as `demo`, with LoRA on and `ENGINE_TOKEN` as its admin token."""
    with run_engine(base, log, "--enable-lora", "--lora-roots", str(adapter_root), "--admin-token", ENGINE_TOKEN,
                    *SHARED_FLAGS, *flags) as server:
        yield server


def engine_adapters(server: EngineServer) -> dict[str, dict]:
    """name -> listing entry of the adapters the engine holds (ready ones, not draining)."""
    body = httpx.get(server.api + "/lora_adapters", timeout=10).json()
    return {a["name"]: a for a in body["adapters"] if a["state"] != "draining"}
