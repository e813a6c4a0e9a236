"""Per-step data passed explicitly from the BatchBuilder to the ModelRunner and down to the layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.model.attention_metadata import AttentionMetadata
from data_plane.model.lora_batch import LoRABatch


@dataclass
class StepInput:
    """One forward pass: flat tokens of every scheduled sequence and their metadata."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: flat index of the token whose logits are sampled, per sequence
    adapter_ids: list[int]  # per scheduled sequence (decodes, then prefills); 0 = base model
    lora: LoRABatch | None = None  # which slot each token uses; None when no token uses an adapter
