"""--lora-dtype (vLLM's flag): the LoRA slots' dtype, from the command line to the slot pool. The tokens
it gives are checked against PEFT on the rounded weights in test_lora_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_plane.api.server import build_parser, config_from_args
from data_plane.config import ConfigError, EngineConfig
from data_plane.lora.model_lora import slot_dtype


def test_the_flag_reaches_the_config_and_defaults_to_the_models_dtype(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    parse = lambda *flags: config_from_args(build_parser().parse_args(["--model", str(tmp_path), *flags]))  # noqa: E731
    assert parse("--enable-lora").lora_dtype == "auto"
    assert parse("--enable-lora", "--lora-dtype", "bfloat16").lora_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse("--lora-dtype", "int8")
    with pytest.raises(ConfigError, match="--lora-dtype"):
        EngineConfig(model=str(tmp_path), lora_dtype="float64")


def test_narrower_slots_need_a_float32_model():
    assert slot_dtype(torch.float32, "auto") is torch.float32
    assert slot_dtype(torch.bfloat16, "auto") is torch.bfloat16
    assert slot_dtype(torch.float32, "bfloat16") is torch.bfloat16
    assert slot_dtype(torch.float32, "float16") is torch.float16
    assert slot_dtype(torch.float16, "float16") is torch.float16  # the model's own dtype: as auto
    with pytest.raises(ValueError, match="float32 model"):  # the kernels mix float32 sums with half slots only
        slot_dtype(torch.bfloat16, "float16")
