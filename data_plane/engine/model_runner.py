"""Owns the model weights and the paged KV cache; runs one forward pass per step."""

from __future__ import annotations

import logging

import torch

from data_plane.config import EngineConfig
from data_plane.engine.tp_group import TensorParallelGroup
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.step_input import StepInput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        tp_group: TensorParallelGroup | None = None,  # rank 0 of a tensor-parallel engine
    ) -> None:
        self.model = model
        self.tp_group = tp_group
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_mb)
        # one tensor per layer: [2 (K, V), num_blocks * block_size, kv_heads, head_dim]
        shape = (2, self.num_blocks * self.block_size, model.num_kv_heads_per_rank, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size, self.kv_cache_bytes / 2**20)

    def _bytes_per_block(self) -> int:
        per_token = 2 * self.model.num_kv_heads_per_rank * self.model.head_dim * self.dtype.itemsize
        return per_token * self.block_size * self.model.num_layers

    def _blocks_for_memory(self, memory_mb: int) -> int:
        return max(2, memory_mb * 2**20 // self._bytes_per_block())

    @property
    def reads_kv_in_place(self) -> bool:
        """Decode attention runs on a kernel that reads the paged cache in place (attention_kernels.py)."""
        return any(getattr(m, "decode_kernel", None) is not None for m in self.model.modules())

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self._bytes_per_block()

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits of each scheduled sequence's last token: [S, vocab] float32."""
        if self.tp_group is not None:
            self.tp_group.run_step(step)  # every rank runs the same step on its shard
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn, step.lora)  # [T, hidden]
        return self.model.compute_logits(hidden[step.logits_indices])
