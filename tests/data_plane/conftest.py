"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_plane.demo.model_builder import write_demo_model
from data_plane.demo.tokenizer_builder import write_tokenizer
from tests.data_plane.checkpoints import FAMILIES, write_tiny_checkpoint


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
