"""Write a small, randomly initialised Qwen2 checkpoint in Hugging Face layout.

The weights carry no knowledge; they are scaled so that greedy decoding wanders over many tokens
instead of repeating one, which is what demos and end-to-end tests need. Same seed, same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from data_plane.demo.tokenizer_builder import (
    ENDOFTEXT,
    IM_END,
    MODEL_MAX_LENGTH,
    special_token_id,
    write_tokenizer,
)

# Standard deviations of the random init. With tied embeddings the final hidden state is scored
# against the embedding table, so the residual stream must not be dominated by the input token's
# own embedding (greedy would echo it forever): the blocks' outputs are made comparatively large.
EMBED_STD = 0.5
LINEAR_STD = 0.1
BIAS_STD = 0.05


@dataclass(frozen=True)
class DemoModelShape:
    num_hidden_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_key_value_heads: int = 2  # GQA: 4 query heads share each KV head
    intermediate_size: int = 768

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _config(shape: DemoModelShape, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **asdict(shape),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def _weights(shape: DemoModelShape, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors named as transformers' Qwen2ForCausalLM names them (no lm_head: it is tied)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, dtype=torch.float32) * std).contiguous()

    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h, std=EMBED_STD)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        # Linear weights are [out_features, in_features], as nn.Linear stores them.
        tensors[f"{p}.self_attn.q_proj.weight"] = normal(h, h, std=LINEAR_STD)
        tensors[f"{p}.self_attn.q_proj.bias"] = normal(h, std=BIAS_STD)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal(kv, h, std=LINEAR_STD)
        tensors[f"{p}.self_attn.k_proj.bias"] = normal(kv, std=BIAS_STD)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal(kv, h, std=LINEAR_STD)
        tensors[f"{p}.self_attn.v_proj.bias"] = normal(kv, std=BIAS_STD)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(h, h, std=LINEAR_STD)
        tensors[f"{p}.mlp.gate_proj.weight"] = normal(shape.intermediate_size, h, std=LINEAR_STD)
        tensors[f"{p}.mlp.up_proj.weight"] = normal(shape.intermediate_size, h, std=LINEAR_STD)
        tensors[f"{p}.mlp.down_proj.weight"] = normal(h, shape.intermediate_size, std=LINEAR_STD)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    return tensors


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_demo_model(
    out_dir: Path, seed: int = 0, shape: DemoModelShape | None = None, vocab_size: int | None = None
) -> list[Path]:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files.

    Returns the written paths. Deterministic: the same seed (and shape) gives byte-identical files.
    vocab_size: the tokenizer's (and so the model's) vocabulary; default the demo tokenizer's.
    """
    shape = shape or DemoModelShape()
    return write_checkpoint(out_dir, vocab_size, lambda vocab, bos, eos: _config(shape, vocab, bos, eos),
                            lambda vocab: _weights(shape, vocab, seed))


def write_checkpoint(
    out_dir: Path,
    vocab_size: int | None,
    config: Callable[[int, int, int], dict[str, Any]],
    weights: Callable[[int], dict[str, torch.Tensor]],
) -> list[Path]:
    """A demo checkpoint's files: the demo tokenizer (`vocab_size` tokens; None: as trained), then
    config.json = config(vocab, bos_id, eos_id), generation_config.json and model.safetensors =
    weights(vocab). Returns the written paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out_dir) if vocab_size is None else write_tokenizer(out_dir, vocab_size)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    endoftext_id, im_end_id = special_token_id(tokenizer, ENDOFTEXT), special_token_id(tokenizer, IM_END)

    _write_json(out_dir / "config.json", config(vocab_size, endoftext_id, im_end_id))
    generation_config = {
        "bos_token_id": endoftext_id,
        # A chat turn ends with <|im_end|>; a raw completion may end with <|endoftext|>.
        "eos_token_id": [im_end_id, endoftext_id],
        "pad_token_id": endoftext_id,
        "do_sample": False,
    }
    _write_json(out_dir / "generation_config.json", generation_config)
    save_file(weights(vocab_size), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    names = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    return [out_dir / name for name in names]
