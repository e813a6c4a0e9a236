"""Linear layers with tensor-parallel sharding as a parameter (tp_rank, tp_size; 0/1 = one device).

Column-parallel layers split the output features across ranks, row-parallel layers split the input
features and sum the partial outputs. Each parameter carries `weight_loader(param, loaded_weight,
shard_id=None)` that copies this rank's slice of the full Hugging Face tensor.

Every forward takes `lora`, the step's LoRA batch: unused here, it keeps one call signature so the
LoRA wrappers (data_plane/lora) can replace these modules without touching the model code.

On the CPU the loader lays the weights out once (data_plane/model/layers/cpu_weights.py): a layer
with a `cpu_weight` multiplies through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.distributed.collectives import tensor_parallel_all_reduce
from data_plane.model.layers.packed import CpuWeight
from data_plane.model.layers.parallel import (
    ShardId,
    check_full_shape,
    copy_checked,
    divide,
    new_parameter,
    set_weight_loader,
)
from data_plane.model.lora_batch import LoRABatch


class LinearBase(nn.Module):
    """y = x W^T (+ b) on this rank's shard: weight [output_size_per_partition, input_size_per_partition]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = new_parameter(output_size_per_partition, input_size_per_partition)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = new_parameter(output_size_per_partition)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    cpu_weight: CpuWeight | None = None  # laid out for the CPU's matmul (layers/cpu_weights.py); then the only copy

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [T, in] -> [T, out]
        """x Wᵀ (+ bias) on this rank's shard, through the CPU layout when there is one."""
        if self.cpu_weight is not None:
            return self.cpu_weight.linear(x, bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}"
        )


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel projections of the same input (output features split across ranks; the output stays
    sharded, no communication), fused into one matmul (gate_up_proj).

    Each rank holds [shard of output 0; shard of output 1; …]; `shard_id` is the index of the output.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.output_sizes_per_partition = [divide(s, tp_size, "output_size") for s in output_sizes]
        super().__init__(
            input_size, sum(output_sizes), input_size, sum(self.output_sizes_per_partition), bias, tp_rank, tp_size
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, int) or shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"shard_id must be an output index 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        check_full_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]))
        n = self.output_sizes_per_partition[shard_id]
        offset = sum(self.output_sizes_per_partition[:shard_id])
        copy_checked(param.data.narrow(0, offset, n), loaded_weight.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(LinearBase):
    """Fused q, k, v projections with grouped-query attention, split by heads across ranks.

    When tp_size > num_kv_heads each rank keeps one kv head and tp_size / num_kv_heads ranks share it
    (replicated). Output per rank: [q (num_heads * D) | k (num_kv_heads * D) | v (num_kv_heads * D)].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            divide(tp_size, total_num_kv_heads, "num_key_value_heads (replicated)")  # tp_size must be a multiple
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * total_num_kv_heads) * head_dim,
            hidden_size,
            self.q_size + 2 * self.kv_size,
            bias,
            tp_rank,
            tp_size,
        )

    @property
    def output_sizes_per_partition(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id == "q":
            full, n, offset, src_index = self.total_num_heads * self.head_dim, self.q_size, 0, self.tp_rank
        elif shard_id in ("k", "v"):
            full, n = self.total_num_kv_heads * self.head_dim, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            src_index = self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_full_shape(loaded_weight, (full, *param.shape[1:]))
        copy_checked(param.data.narrow(0, offset, n), loaded_weight.narrow(0, src_index * n, n))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce) when tp_size > 1.

    The bias is added once, after the reduction, so it is not counted tp_size times.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
    ) -> None:
        in_pp = divide(input_size, tp_size, "input_size")
        super().__init__(input_size, output_size, in_pp, output_size, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_checked(param.data, loaded_weight)
            return
        check_full_shape(loaded_weight, (self.output_size, self.input_size))
        n = self.input_size_per_partition
        copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # x: [T, in / tp] -> [T, out]
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x)
        if self.reduce_results:
            y = self.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """TP hook: sums partial outputs over the tensor-parallel group (LoRA wrappers reuse it)."""
        return tensor_parallel_all_reduce(y)
