"""Wraps a loaded Llama-family model's projections with LoRA layers and returns the slot manager."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.lora.layers import Lane, LinearWithLoRA, RowShard
from data_plane.lora.slots import LoRASlotManager
from data_plane.model.layers.linear import LinearBase, RowParallelLinear
from data_plane.model.llama import LlamaDecoderLayer, LlamaForCausalLM


def _lanes(names: list[str], sizes: list[int], sources: list[int]) -> list[Lane]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Lane(*fields) for fields in zip(names, offsets, sizes, sources, strict=True)]


def slot_dtype(model_dtype: torch.dtype, lora_dtype: str) -> torch.dtype:
    """The LoRA slots' dtype: the model's (auto), or a narrower one under a float32 model."""
    if lora_dtype == "auto":
        return model_dtype
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[lora_dtype]
    if dtype != model_dtype and model_dtype != torch.float32:
        raise ValueError(f"--lora-dtype {lora_dtype} with a {str(model_dtype).removeprefix('torch.')} model: "
                         "narrower slots need a float32 model (or use auto)")
    return dtype


def _row_shard(base: RowParallelLinear, fused: bool) -> RowShard | None:
    if base.tp_size == 1:
        return None
    size = base.input_size_per_partition
    return RowShard(base.tp_rank * size, size, fused)


def _replace(parent: nn.Module, name: str, wrapped: LinearWithLoRA) -> LinearWithLoRA:
    """parent.name := wrapped: the model declares its base linear there, which the wrapper stands in for."""
    setattr(parent, name, wrapped)
    return wrapped


def enable_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int, fused_row_allreduce: bool = False,
                lora_dtype: str = "auto") -> LoRASlotManager:
    """Replace every decoder layer's qkv/o/gate_up/down projection by a LinearWithLoRA around it.

    lora_dtype: the slots' dtype, auto (the model's) or, for a float32 model, bfloat16 or float16: half
    the bytes per step, the adapters' weights rounded to it once (when their slot image is made)."""
    weight = next(model.parameters())
    device = weight.device
    dtype = slot_dtype(weight.dtype, lora_dtype)

    def wrap(base: LinearBase, lanes: list[Lane], row_shard: RowShard | None = None) -> LinearWithLoRA:
        return LinearWithLoRA(base, base.input_size_per_partition, lanes, max_loras, max_rank, dtype, device, row_shard)

    per_layer: list[list[LinearWithLoRA]] = []
    with torch.no_grad():
        for layer in model.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)  # an nn.ModuleList yields plain Modules
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj
            rank = qkv.tp_rank
            kv_source = (rank // qkv.kv_replicas) * qkv.kv_size  # replicated kv heads: the head this rank keeps
            qkv_lora = _replace(attn, "qkv_proj", wrap(qkv, _lanes(
                ["q_proj", "k_proj", "v_proj"], [qkv.q_size, qkv.kv_size, qkv.kv_size],
                [rank * qkv.q_size, kv_source, kv_source],
            )))
            o = attn.o_proj
            o_lora = _replace(attn, "o_proj", wrap(
                o, _lanes(["o_proj"], [o.output_size_per_partition], [0]), _row_shard(o, fused_row_allreduce)))
            gate_up = mlp.gate_up_proj
            size = gate_up.output_sizes_per_partition[0]
            gate_up_lora = _replace(mlp, "gate_up_proj", wrap(
                gate_up, _lanes(["gate_proj", "up_proj"], [size, size], [rank * size, rank * size])))
            down = mlp.down_proj
            down_lora = _replace(mlp, "down_proj", wrap(
                down, _lanes(["down_proj"], [down.output_size_per_partition], [0]), _row_shard(down, fused_row_allreduce)))
            per_layer.append([qkv_lora, o_lora, gate_up_lora, down_lora])
    return LoRASlotManager(per_layer, max_loras)
