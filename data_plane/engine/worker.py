"""One rank's setup, the same on every rank: device, process group, model shard, LoRA slots, KV cache.

Rank 0 (LLMEngine.from_config) also spawns ranks 1..N-1 of a tensor-parallel engine; each of them runs
worker_main, which builds its runner the same way and then follows rank 0's broadcasts (tp_group.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from data_plane.config import EngineConfig
from data_plane.device import resolve_device
from data_plane.distributed.parallel_state import destroy_group, init_group, set_cpu_threads
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.tp_group import TensorParallelGroup, follow_rank0, receive_num_kv_blocks
from data_plane.lora.model_lora import enable_lora
from data_plane.lora.slots import LoRASlotManager
from data_plane.model.config import ModelConfig
from data_plane.model.loader import load_model
from shared.logging_setup import LOG_FORMAT_ENV, configure_logging


@dataclass
class RankRunner:
    runner: ModelRunner
    model_config: ModelConfig
    lora_slots: LoRASlotManager | None


def build_runner(config: EngineConfig, rank: int = 0, init_method: str | None = None) -> RankRunner:
    """Load this rank's shard and size its KV cache; finalizes `config` for the model.

    Rank 0 joins the process group through its TensorParallelGroup (which spawns the other ranks with
    their rank and init_method); the others join with init_method. Every rank joins before loading,
    so that all load at once, and allocates as many KV blocks as rank 0 found room for.
    """
    tp = config.tensor_parallel_size
    device = resolve_device(config.device)
    if rank > 0 and device.type != "cpu":
        device = torch.device(device.type, rank)  # one accelerator per rank
    if device.type == "cpu":
        set_cpu_threads(config.num_threads, tp)
    tp_group = None
    if rank == 0 and tp > 1:
        tp_group = TensorParallelGroup(config, device, worker_main)  # the workers start loading now
    elif rank > 0:
        assert init_method is not None
        init_group(rank, tp, device, init_method)
    model, model_config = load_model(Path(config.model), dtype=config.dtype, device=device, tp_rank=rank, tp_size=tp)
    lora_slots = None
    if config.enable_lora:
        lora_slots = enable_lora(model, config.max_loras, config.max_lora_rank, config.lora_fused_row_allreduce,
                                 config.lora_dtype)
    if rank > 0:
        config = replace(config, num_kv_blocks=receive_num_kv_blocks())
    config.finalize(model_config.max_position_embeddings)
    runner = ModelRunner(model, config, device, next(model.parameters()).dtype, tp_group)
    if tp_group is not None:
        tp_group.start(runner.num_blocks)
        if lora_slots is not None:
            lora_slots.mirror = tp_group.write_lora_slot  # every slot write reaches every rank
    return RankRunner(runner, model_config, lora_slots)


def worker_main(rank: int, config: EngineConfig, init_method: str) -> None:
    """Ranks 1..N-1: load this rank's shard, then run whatever rank 0 broadcasts, until shutdown."""
    # a spawned rank starts afresh: the format rank 0 chose comes in its environment (server.main sets it)
    configure_logging("warning", os.environ.get(LOG_FORMAT_ENV, "text"))
    built = build_runner(config, rank, init_method)
    follow_rank0(built.runner.forward, built.lora_slots.write_slot if built.lora_slots else None)
    destroy_group()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush
