"""LoRA wrapper around a base linear layer: base output plus the routed adapters' deltas.

One wrapper serves every linear kind; a kind is described by its *lanes*, the output slices that
separate HF projections map to: QKV has lanes q_proj/k_proj/v_proj, gate_up has gate_proj/up_proj,
o_proj and down_proj have one lane each. Weights are kept zero-padded past each adapter's rank with
the scale folded into B, so an empty slot or an untargeted lane adds exactly zero. Stored input-major
(see ops.py): the lanes' A stacked into one [max_loras, in, L * max_rank], B as one
[max_loras, max_rank, out] whose columns are the lanes' outputs; once the slot manager is built both
are views of its slot pool (slot_pool.py). The mixed-adapter ops run on the device's kernels
(kernels/select.py), chosen when the layer is built.

Tensor parallelism is a parameter, not another class. Column-parallel layers (qkv, gate_up) keep A
whole and this rank's rows of each lane's B (`Lane.source_offset`, with GQA's replicated kv heads).
Row-parallel layers (o_proj, down_proj) see a shard of the input, so they keep this rank's columns of
A (`RowShard`) and the whole B, and either all-reduce the rank-sized shrink output before expanding
(default) or add each rank's partial delta before the base layer's own all-reduce (`fused`: one
all-reduce per layer instead of two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from data_plane.distributed.collectives import tensor_parallel_all_reduce
from data_plane.lora.kernels.select import select_kernels
from data_plane.lora.ops import lora_expand, lora_shrink, lora_shrink_expand
from data_plane.lora.weights import LoRAModuleWeights
from data_plane.model.layers.linear import LinearBase, RowParallelLinear
from data_plane.model.lora_batch import LoRABatch


@dataclass(frozen=True)
class Lane:
    module: str  # Hugging Face projection name, e.g. "k_proj"
    offset: int  # first output column of this lane in this rank's fused output
    size: int  # its width on this rank
    source_offset: int = 0  # first row of this rank's part in the full PEFT lora_B of the module


@dataclass(frozen=True)
class RowShard:
    """A row-parallel layer's part of the input features on this rank."""

    start: int
    size: int
    fused_all_reduce: bool = False


class LinearWithLoRA(nn.Module):
    lora_a: torch.Tensor  # buffers (register_buffer), then views of the slot pool
    lora_b: torch.Tensor

    def __init__(
        self,
        base: LinearBase,
        in_features: int,
        lanes: list[Lane],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        row_shard: RowShard | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.lanes = lanes
        self.max_rank = max_rank
        self.row_shard = row_shard
        out_features = sum(lane.size for lane in lanes)
        self.register_buffer("lora_a", torch.zeros(max_loras, in_features, len(lanes) * max_rank, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device))
        self.lane_columns = [(lane.offset, lane.size) for lane in lanes]
        self.kernels = select_kernels(device)  # chosen (and on the CPU compiled) once, at engine start

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, in]
        shard = self.row_shard
        if lora is not None and shard is not None and shard.fused_all_reduce:
            y: torch.Tensor = self.base.matmul(x)  # this rank's partial sum
            lora_shrink_expand(y, x, self.lora_a, self.lora_b, self.lane_columns, lora, self.kernels)  # partial delta too
            y = cast(RowParallelLinear, self.base).all_reduce(y)  # a row shard is only given to row-parallel layers
            return y if self.base.bias is None else y + self.base.bias
        y = self.base(x)  # [T, out]
        if lora is None:
            return y
        if shard is None:  # one device, or column-parallel: nothing to reduce
            lora_shrink_expand(y, x, self.lora_a, self.lora_b, self.lane_columns, lora, self.kernels)
        else:
            v = tensor_parallel_all_reduce(lora_shrink(x, self.lora_a, len(self.lanes), lora, self.kernels))  # [T, L * rank]
            lora_expand(y, v, self.lora_b, self.lane_columns, lora, self.kernels)
        return y

    def lane_modules(self) -> list[str]:
        return [lane.module for lane in self.lanes]

    @torch.no_grad()
    def fill_slot_image(self, a: torch.Tensor, b: torch.Tensor, modules: dict[str, LoRAModuleWeights]) -> None:
        """Write one adapter's lanes of this layer into a zeroed slot image (slot_pool.py): a: [in, L * R],
        b: [R, out], as one slot of lora_a and lora_b; lanes the adapter does not target stay zero."""
        for index, lane in enumerate(self.lanes):
            weights = modules.get(lane.module)
            if weights is None:
                continue
            rank = weights.rank
            a_t = weights.a_t  # [in_full, r]
            if self.row_shard is not None:
                a_t = a_t[self.row_shard.start : self.row_shard.start + self.row_shard.size]
            a[:, index * self.max_rank : index * self.max_rank + rank].copy_(a_t)
            b_t = weights.b_t[:, lane.source_offset : lane.source_offset + lane.size]  # [r, out_l]
            torch.mul(b_t, weights.scaling, out=b[:rank, lane.offset : lane.offset + lane.size])
