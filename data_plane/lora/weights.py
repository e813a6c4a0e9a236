"""What a validated PEFT adapter looks like once read from disk (host memory, float32 or model dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.peft import TARGET_MODULES

__all__ = ["TARGET_MODULES", "LoRAAdapterWeights", "LoRAModuleWeights"]


@dataclass
class LoRAModuleWeights:
    lora_a: torch.Tensor  # [r, in_features], as PEFT stores it
    lora_b: torch.Tensor  # [out_features, r]
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA; folded into B when copied into a slot

    def __post_init__(self) -> None:
        # The slots' input-major layout, made here, where the adapter is read (off the engine loop), so
        # that copying into a slot is a plain copy per tensor. These are transposed views made contiguous:
        # lora_a / lora_b become views of them, so the host copy is not held twice.
        self.a_t = self.lora_a.T.contiguous()  # [in, r]
        self.b_t = self.lora_b.T.contiguous()  # [r, out]
        self.lora_a, self.lora_b = self.a_t.T, self.b_t.T

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
