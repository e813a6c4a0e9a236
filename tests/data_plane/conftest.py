"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import write_demo_model
from data_plane.demo.tokenizer_builder import write_tokenizer
from data_plane.lora.weights import TARGET_MODULES, LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from tests.data_plane.checkpoints import FAMILIES, write_tiny_checkpoint
from tests.data_plane.peft_adapters import write_peft_adapter

PeftAdapters = Callable[[str, str], Path]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family ("llama", "qwen2", "qwen3") -> directory of a tiny random float32 checkpoint, written once."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {family: write_tiny_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def engine_checkpoints(tiny_checkpoints: dict[str, Path]) -> dict[str, Path]:
    """The tiny checkpoints plus a tokenizer of matching vocabulary (the engine needs one)."""
    for path in tiny_checkpoints.values():
        if not (path / "tokenizer.json").exists():
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            write_tokenizer(path, vocab_size=vocab)
    return tiny_checkpoints


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model `loraplane demo-model` writes (seed 0), with its tokenizer: what real servers run."""
    path = tmp_path_factory.mktemp("demo_model") / "demo"
    write_demo_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def peft_adapters(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> PeftAdapters:
    """PEFT adapters on the tiny checkpoints, written on first use: a maker (family, kind) -> adapter folder,
    cached for the session so each is written once, when first asked for. Session-scoped (not per test) so
    module-scoped fixtures may use it; the folders are shared and must not be modified: copy one
    (shutil.copytree) before editing it."""
    root = tmp_path_factory.mktemp("peft_adapters")
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, kind: str) -> Path:
        if (family, kind) not in cache:
            cache[(family, kind)] = write_peft_adapter(tiny_checkpoints[family], root / f"{family}-{kind}", kind)
        return cache[(family, kind)]

    return make


@pytest.fixture(scope="session")
def demo_adapter(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoRAAdapterWeights:
    """A real adapter of the demo model, as the registry hands it to the engine."""
    root = tmp_path_factory.mktemp("core_adapters")
    spec = DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES)
    path = write_lora_adapter(demo_model_dir, root / "a1", spec, seed=1)
    return load_peft_adapter(path, ModelConfig.from_pretrained(demo_model_dir), max_rank=8, allowed_roots=[str(root)])
