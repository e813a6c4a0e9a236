"""Rank 0's handle on the tensor-parallel workers, and the workers' loop.

Rank 0 owns the API, the scheduler and sampling. Before each forward pass it broadcasts the step's
StepInput (token ids, positions, block tables, slot mapping, adapter ids and per-token LoRA slots),
and before each LoRA slot write the slot and the adapter's weights; every rank then runs the same
forward on its shard, meeting in the layers' all-reduces. Workers never decide anything, so they can
never disagree with rank 0 about which adapter a token uses.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from data_plane.config import EngineConfig
from data_plane.distributed.collectives import broadcast_from_rank0
from data_plane.distributed.parallel_state import (
    destroy_group,
    free_tcp_init_method,
    init_group,
    launched_by_torchrun,
    set_cpu_threads,
)
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.step_input import StepInput
from shared.errors import EngineDeadError

logger = logging.getLogger(__name__)


class TensorParallelGroup:
    """Held by rank 0: spawns ranks 1..N-1 (or finds them under torchrun) and broadcasts to them."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.processes: list[mp.Process] = []
        if launched_by_torchrun():
            init_method = "env://"
        else:
            init_method = free_tcp_init_method()
            ctx = mp.get_context("spawn")
            for rank in range(1, self.size):
                proc = ctx.Process(target=worker_main, args=(rank, config, init_method), name=f"tp-rank-{rank}", daemon=True)
                proc.start()
                self.processes.append(proc)
        init_group(0, self.size, device, init_method)

    def start(self, num_kv_blocks: int) -> None:
        """After rank 0 has sized its KV cache: every rank allocates the same number of blocks."""
        self._send(("init", num_kv_blocks))

    def run_step(self, step: StepInput) -> None:
        self._send(("step", step))

    def write_lora_slot(self, slot: int, weights: LoRAAdapterWeights | None) -> None:
        self._send(("lora_write", slot, weights))

    def shutdown(self) -> None:
        try:
            if self._dead_rank() is None:
                broadcast_from_rank0(("shutdown",))
        finally:
            destroy_group()
            for proc in self.processes:
                proc.join(timeout=10)

    def _send(self, message: tuple) -> None:
        dead = self._dead_rank()
        if dead is not None:
            raise EngineDeadError(f"tensor-parallel rank {dead[0]} died (exit code {dead[1]}); restart the engine")
        broadcast_from_rank0(message)

    def _dead_rank(self) -> tuple[int, int | None] | None:
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                return rank, proc.exitcode
        return None


def worker_main(rank: int, config: EngineConfig, init_method: str) -> None:
    """Ranks 1..N-1: load this rank's shard, then run whatever rank 0 broadcasts, until shutdown."""
    # imported here: model_runner imports this module
    from data_plane.device import resolve_device
    from data_plane.engine.model_runner import ModelRunner
    from data_plane.lora.model_lora import enable_lora
    from data_plane.model.loader import load_model

    logging.basicConfig(level=logging.WARNING)
    device = resolve_device(config.device)
    if device.type != "cpu":
        device = torch.device(device.type, rank)
    if device.type == "cpu":
        set_cpu_threads(config.num_threads, config.tensor_parallel_size)
    init_group(rank, config.tensor_parallel_size, device, init_method)  # first, so all ranks load at once
    model, model_config = load_model(
        Path(config.model), dtype=config.dtype, device=device, tp_rank=rank, tp_size=config.tensor_parallel_size
    )
    slots = (
        enable_lora(model, config.max_loras, config.max_lora_rank, config.lora_fused_row_allreduce)
        if config.enable_lora
        else None
    )
    kind, num_kv_blocks = broadcast_from_rank0()
    assert kind == "init"
    config = replace(config, num_kv_blocks=num_kv_blocks)
    config.finalize(model_config.max_position_embeddings)
    runner = ModelRunner(model, config, device, next(model.parameters()).dtype)
    while True:
        message = broadcast_from_rank0()
        if message[0] == "step":
            runner.forward(message[1])
        elif message[0] == "lora_write":
            slots.write_slot(message[1], message[2])
        elif message[0] == "shutdown":
            break
    destroy_group()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush
