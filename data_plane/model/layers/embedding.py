"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Rank r owns rows [r * V_pp, (r + 1) * V_pp) of the (padded) vocabulary, V_pp = ceil(vocab / tp_size);
rows past the real vocabulary are zero and their logits are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.distributed.collectives import tensor_parallel_all_gather, tensor_parallel_all_reduce
from data_plane.model.layers.packed import CpuWeight
from data_plane.model.layers.parallel import ShardId, check_full_shape, new_parameter, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        """`shared_weight`: use this (identically sharded) parameter instead of allocating one (tied head)."""
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        if shared_weight is not None:
            self.weight = shared_weight
        else:
            self.weight = new_parameter(self.num_embeddings_per_partition, embedding_dim)
            set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        check_full_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # input_ids: [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # ids owned by another rank look up row 0 and are zeroed; the all-reduce fills them in
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return tensor_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; tied models pass the embedding's weight as shared_weight."""

    cpu_weight: CpuWeight | None = None  # laid out for the CPU's matmul (layers/cpu_weights.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [S, hidden] -> [S, vocab] float32
        # logits in the model dtype (as HF computes them), cast afterwards
        laid_out = self.cpu_weight
        logits = F.linear(hidden, self.weight) if laid_out is None else laid_out.linear(hidden)
        if self.tp_size > 1:
            logits = tensor_parallel_all_gather(logits)
        return logits[:, : self.num_embeddings].float()
