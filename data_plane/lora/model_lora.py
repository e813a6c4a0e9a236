"""Wraps a loaded Llama-family model's projections with LoRA layers and returns the slot manager."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.lora.layers import Lane, LinearWithLoRA
from data_plane.lora.slots import LoRASlotManager


def _lanes(names: list[str], sizes: list[int]) -> list[Lane]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Lane(n, o, s) for n, o, s in zip(names, offsets, sizes, strict=True)]


def enable_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRASlotManager:
    """Replace every decoder layer's qkv/o/gate_up/down projection by a LinearWithLoRA around it."""
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device

    def wrap(base: nn.Module, lanes: list[Lane]) -> LinearWithLoRA:
        return LinearWithLoRA(base, base.input_size_per_partition, lanes, max_loras, max_rank, dtype, device)

    per_layer: list[list[LinearWithLoRA]] = []
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj
            attn.qkv_proj = wrap(qkv, _lanes(["q_proj", "k_proj", "v_proj"], [qkv.q_size, qkv.kv_size, qkv.kv_size]))
            attn.o_proj = wrap(attn.o_proj, _lanes(["o_proj"], [attn.o_proj.output_size_per_partition]))
            gate_up = mlp.gate_up_proj
            mlp.gate_up_proj = wrap(gate_up, _lanes(["gate_proj", "up_proj"], gate_up.output_sizes_per_partition))
            mlp.down_proj = wrap(mlp.down_proj, _lanes(["down_proj"], [mlp.down_proj.output_size_per_partition]))
            per_layer.append([attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj])
    return LoRASlotManager(per_layer, max_loras)
