"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data_plane.checkpoints import FAMILIES, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family ("llama", "qwen2", "qwen3") -> directory of a tiny random float32 checkpoint, written once."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {family: write_tiny_checkpoint(root / family, family) for family in FAMILIES}
