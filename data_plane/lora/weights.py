"""What a validated PEFT adapter looks like once read from disk (host memory, float32 or model dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Hugging Face projection names that loraplane can adapt, and where each lands in the fused layers.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAModuleWeights:
    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [out_features, r]
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA; folded into B when copied into a slot

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapterWeights:
    """A PEFT adapter validated against the base model: per layer, per projection, A and B."""

    path: str
    sha256: str  # over adapter_config.json and the weights file: the content identity of this version
    rank: int  # the largest rank of any module (rank_pattern may vary it)
    alpha: float
    target_modules: list[str]  # short names among TARGET_MODULES
    size_bytes: int
    layers: dict[int, dict[str, LoRAModuleWeights]] = field(default_factory=dict)  # layer -> module -> weights

    @property
    def cache_namespace(self) -> int:
        """Seed of the first KV block hash: derived from the content, never 0 (0 is the base model)."""
        return int(self.sha256[:16], 16) or 1
