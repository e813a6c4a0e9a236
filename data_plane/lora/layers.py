"""LoRA wrapper around a base linear layer: base output plus the routed adapters' deltas.

One wrapper serves every linear kind; a kind is described by its *lanes*, the output slices that
separate HF projections map to: QKV has lanes q_proj/k_proj/v_proj, gate_up has gate_proj/up_proj,
o_proj and down_proj have one lane each. Each lane keeps its own stacked slot weights
A and B, zero-padded past the adapter's
rank and with the scale folded into B, so an empty slot or an untargeted lane adds exactly zero.
Stored input-major (see ops.py): the lanes' A stacked into one [max_loras, in, L * max_rank] so that
one shrink serves all, B as one [max_loras, max_rank, out] whose columns are the lanes' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from data_plane.lora.batch import LoRABatch
from data_plane.lora.ops import lora_shrink_expand


@dataclass(frozen=True)
class Lane:
    module: str  # Hugging Face projection name, e.g. "k_proj"
    offset: int  # first output column of this lane in the fused layer's output
    size: int


class LinearWithLoRA(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        lanes: list[Lane],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.lanes = lanes
        self.max_rank = max_rank
        out_features = sum(lane.size for lane in lanes)
        self.register_buffer("lora_a", torch.zeros(max_loras, in_features, len(lanes) * max_rank, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device))
        self.lane_columns = [(lane.offset, lane.size) for lane in lanes]

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, in]
        y = self.base(x)  # [T, out]
        if lora is None:
            return y
        lora_shrink_expand(y, x, self.lora_a, self.lora_b, self.lane_columns, lora)
        return y

    def lane_modules(self) -> list[str]:
        return [lane.module for lane in self.lanes]

    @torch.no_grad()
    def set_slot(
        self, slot: int, module: str, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scaling: float = 1.0
    ) -> None:
        """Write one lane of one slot from PEFT's A [r, in] and B [out, r]; None clears the lane."""
        index = self.lane_modules().index(module)
        lane = self.lanes[index]
        slot_a = self.lora_a[slot, :, index * self.max_rank : (index + 1) * self.max_rank]  # [in, R]
        slot_b = self.lora_b[slot, :, lane.offset : lane.offset + lane.size]  # [R, out_l]
        rank = 0 if lora_a is None or lora_b is None else lora_a.shape[0]
        if rank:
            slot_a[:, :rank].copy_(lora_a.T)
            slot_b[:rank].copy_(lora_b.T)
            slot_b[:rank].mul_(scaling)
        # only the padding past this adapter's rank needs clearing: the rest was just overwritten
        slot_a[:, rank:].zero_()
        slot_b[rank:].zero_()
