"""LoRA wrapper around a base linear layer: base output plus the routed adapters' deltas.

One wrapper serves every linear kind; a kind is described by its *lanes*, the output slices that
separate HF projections map to: QKV has lanes q_proj/k_proj/v_proj, gate_up has gate_proj/up_proj,
o_proj and down_proj have one lane each. Each lane keeps its own stacked slot weights
A [max_loras, max_rank, in] and B [max_loras, out_lane, max_rank], zero-padded past the adapter's
rank and with the scale folded into B, so an empty slot or an untargeted lane adds exactly zero.
The lanes' A are stacked into one tensor [max_loras, L * max_rank, in] so that one shrink serves all.
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
        self.register_buffer("lora_a", torch.zeros(max_loras, len(lanes) * max_rank, in_features, dtype=dtype, device=device))
        for i, lane in enumerate(lanes):
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, lane.size, max_rank, dtype=dtype, device=device))
        self.lora_bs = [getattr(self, f"lora_b_{i}") for i in range(len(lanes))]

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, in]
        y = self.base(x)  # [T, out]
        if lora is None:
            return y
        lane_outputs = [y[:, lane.offset : lane.offset + lane.size] for lane in self.lanes]
        lora_shrink_expand(lane_outputs, x, self.lora_a, self.lora_bs, lora)
        return y

    def lane_modules(self) -> list[str]:
        return [lane.module for lane in self.lanes]

    @torch.no_grad()
    def set_slot(self, slot: int, module: str, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None) -> None:
        """Write one lane of one slot: A [r, in], B [out, r] already scaled; None clears the lane."""
        index = self.lane_modules().index(module)
        slot_a = self.lora_a[slot, index * self.max_rank : (index + 1) * self.max_rank]  # [R, in]
        slot_b = self.lora_bs[index][slot]  # [out_l, R]
        slot_a.zero_()
        slot_b.zero_()
        if lora_a is not None and lora_b is not None:
            rank = lora_a.shape[0]
            slot_a[:rank].copy_(lora_a)
            slot_b[:, :rank].copy_(lora_b)
