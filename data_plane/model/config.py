"""The base model's architecture, parsed once from a Hugging Face config.json and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import UnsupportedModelError

# All four share one layout: pre-norm decoder, SwiGLU MLP, RMSNorm, rotary GQA attention.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalized: always has "rope_type"; None = plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before rope
    hidden_act: str = "silu"
    sliding_window: int | None = None  # only set when the checkpoint actually uses one (refused)
    dtype: str | None = None  # checkpoint dtype ("bfloat16", …); None if the config does not say
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # Llama 3.1 lists several

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_architecture(self.architecture)
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' is supported")
        if self.sliding_window is not None:
            raise UnsupportedModelError(
                f"sliding-window attention (window {self.sliding_window}) is not supported"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_scaling and float(self.rope_scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type, model_type or "?")
        if architecture not in SUPPORTED_ARCHITECTURES:
            # refuse before reading fields an unknown architecture may name differently
            raise _unsupported_architecture(architecture)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        absent = [k for k in required if k not in raw]
        if absent:
            raise UnsupportedModelError(f"config.json of {architecture} lacks {', '.join(absent)}")
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(raw)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        # Qwen2/3 configs carry sliding_window but only use it when use_sliding_window is true
        uses_window = raw.get("use_sliding_window", architecture == "MistralForCausalLM")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
            o_proj_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            hidden_act=raw.get("hidden_act", "silu"),
            sliding_window=raw.get("sliding_window") if uses_window else None,
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


def _unsupported_architecture(architecture: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Accept both rope spellings: transformers 5 writes `rope_parameters` (theta inside), hub checkpoints
    (Llama 3.1, Qwen2.5) write `rope_theta` + `rope_scaling` with either `rope_type` or legacy `type`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default" and not scaling:
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}
