"""Fixtures of the LoRA tests: PEFT adapters on the tiny checkpoints, written on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.data_plane.lora.adapters import write_peft_adapter

PeftAdapters = Callable[[str, str], Path]


@pytest.fixture(scope="session")
def peft_adapters(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> PeftAdapters:
    """A maker (family, kind) -> adapter folder, cached for the session so each is written once, when first
    asked for. Session-scoped (not per test) so module-scoped fixtures may use it; the folders are shared
    and must not be modified: copy one (shutil.copytree) before editing it."""
    root = tmp_path_factory.mktemp("peft_adapters")
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, kind: str) -> Path:
        if (family, kind) not in cache:
            cache[(family, kind)] = write_peft_adapter(tiny_checkpoints[family], root / f"{family}-{kind}", kind)
        return cache[(family, kind)]

    return make
