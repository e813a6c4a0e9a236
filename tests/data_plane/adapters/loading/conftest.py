"""Adapter folders and the reading of them that the reader process tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_plane.adapters.loading.spec import AdapterReading
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.lora.weights import TARGET_MODULES
from data_plane.model.config import ModelConfig


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reader_adapters")
    for i, r in enumerate((8, 8, 16)):
        write_lora_adapter(demo_model_dir, root / f"a{i}", DemoAdapter(r=r, lora_alpha=2 * r, target_modules=TARGET_MODULES),
                           seed=i)
    return root


@pytest.fixture(scope="module")
def reading(demo_model_dir: Path, adapters: Path) -> AdapterReading:
    return AdapterReading(ModelConfig.from_pretrained(demo_model_dir), max_rank=8, lora_roots=(str(adapters),))
