"""Realistically sized random checkpoints for benchmarks: `loraplane demo-model --preset NAME DIR`.

A preset is a Llama-architecture checkpoint (untied lm_head, no biases) in Hugging Face layout, with the
demo tokenizer padded to the preset's vocabulary, and N PEFT adapters of one shape. The weights carry no
knowledge; linear weights are scaled by 1/sqrt(fan-in) so that a deep stack keeps its activations in
range and greedy decoding wanders over many tokens. Same seed, same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import DemoModelShape, write_checkpoint
from data_plane.demo.tokenizer_builder import MODEL_MAX_LENGTH

EMBED_STD = 1.0
LINEAR_GAIN = 1.0  # std of a linear weight: LINEAR_GAIN / sqrt(in_features)
ADAPTER_DELTA_STD = 0.4  # std of each delta scale * B @ A, as a multiple of its base weight's std


@dataclass(frozen=True)
class ModelPreset:
    shape: DemoModelShape
    vocab_size: int
    dtype: torch.dtype
    adapter: DemoAdapter  # the shape of each of the preset's adapters

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def with_layers(self, layers: int) -> ModelPreset:
        """The same preset with another layer count (tests: a shallower stack of the same width)."""
        return replace(self, shape=replace(self.shape, num_hidden_layers=layers))


PRESETS: dict[str, ModelPreset] = {
    # 246 M parameters: the model of the CPU comparison with vLLM (bench/peer.py)
    "llama-250m": ModelPreset(
        shape=DemoModelShape(num_hidden_layers=16, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                             intermediate_size=2816),
        vocab_size=32000,
        dtype=torch.bfloat16,
        adapter=DemoAdapter(r=16, lora_alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    ),
}
PRESET_ADAPTERS_DEFAULT = 128  # what bench/peer.py's largest shape serves


def adapter_name(index: int) -> str:
    return f"lora-{index:03d}"


def _config(preset: ModelPreset, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(preset.shape),
        "head_dim": preset.shape.head_dim,
        "vocab_size": preset.vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": preset.dtype_name,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def _linear_features(shape: DemoModelShape) -> dict[str, tuple[int, int]]:
    """Each linear's (out_features, in_features), as nn.Linear's weight [out, in]."""
    h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def _weights(preset: ModelPreset, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors named as transformers' LlamaForCausalLM names them, in preset.dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape, h = preset.shape, preset.shape.hidden_size

    def normal(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, dtype=torch.float32) * std).to(preset.dtype).contiguous()

    yield "model.embed_tokens.weight", normal(preset.vocab_size, h, std=EMBED_STD)
    for i in range(shape.num_hidden_layers):
        for name, (out_f, in_f) in _linear_features(shape).items():
            yield f"model.layers.{i}.{name}.weight", normal(out_f, in_f, std=LINEAR_GAIN / math.sqrt(in_f))
        yield f"model.layers.{i}.input_layernorm.weight", torch.ones(h, dtype=preset.dtype)
        yield f"model.layers.{i}.post_attention_layernorm.weight", torch.ones(h, dtype=preset.dtype)
    yield "model.norm.weight", torch.ones(h, dtype=preset.dtype)
    yield "lm_head.weight", normal(preset.vocab_size, h, std=1.0 / math.sqrt(h))


def write_preset_model(out_dir: Path, preset: ModelPreset, seed: int = 0) -> list[Path]:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files; the paths."""
    return write_checkpoint(out_dir, preset.vocab_size, lambda _vocab, bos, eos: _config(preset, bos, eos),
                            lambda _vocab: dict(_weights(preset, seed)))


def write_preset_adapters(base_dir: Path, out_root: Path, preset: ModelPreset, count: int, seed: int = 0, *,
                          skip_existing: bool = True, base_model: str | None = None) -> dict[str, Path]:
    """Write adapters lora-000 ... to out_root/<name> in preset.dtype (those already there are kept when
    skip_existing); name -> folder. Each delta's std is ADAPTER_DELTA_STD times its base weights'."""
    written: dict[str, Path] = {}
    delta_std = ADAPTER_DELTA_STD * LINEAR_GAIN / math.sqrt(preset.shape.hidden_size)  # q/k/v/o/gate/up: fan-in h
    for index in range(count):
        name = adapter_name(index)
        folder = Path(out_root) / name
        if skip_existing and (folder / "adapter_config.json").exists():
            continue
        written[name] = write_lora_adapter(base_dir, folder, preset.adapter, seed * 1_000_003 + index,
                                           base_model=base_model, delta_std=delta_std, dtype=preset.dtype)
    return written
