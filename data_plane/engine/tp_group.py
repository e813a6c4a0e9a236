"""The tensor-parallel message protocol: rank 0's handle on the workers, and what the workers follow.

Rank 0 owns the API, the scheduler and sampling. Before each forward pass it broadcasts the step's
StepInput (token ids, positions, block tables, slot mapping, adapter ids and per-token LoRA slots),
and before each LoRA slot write the slot and the adapter's weights; every rank then runs the same
forward on its shard, meeting in the layers' all-reduces. Workers never decide anything, so they can
never disagree with rank 0 about which adapter a token uses.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Literal, cast

import torch
import torch.multiprocessing as mp

from data_plane.config import EngineConfig
from data_plane.distributed.collectives import broadcast_from_rank0
from data_plane.distributed.parallel_state import (
    destroy_group,
    free_tcp_init_method,
    init_group,
    launched_by_torchrun,
)
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.step_input import StepInput
from shared.errors import EngineDeadError

# what a spawned rank runs: (rank, config, init_method); worker.worker_main
WorkerMain = Callable[[int, EngineConfig, str], None]

# What rank 0 broadcasts, tagged by the first item: the KV blocks to allocate, a step to run, a LoRA slot
# to write (None: clear it), or the end.
InitMessage = tuple[Literal["init"], int]
StepMessage = tuple[Literal["step"], StepInput]
LoRAWriteMessage = tuple[Literal["lora_write"], int, LoRAAdapterWeights | None]
ShutdownMessage = tuple[Literal["shutdown"]]
Message = InitMessage | StepMessage | LoRAWriteMessage | ShutdownMessage


class TensorParallelGroup:
    """Held by rank 0: spawns ranks 1..N-1 (or finds them under torchrun) and broadcasts to them."""

    def __init__(self, config: EngineConfig, device: torch.device, worker: WorkerMain) -> None:
        self.size = config.tensor_parallel_size
        self.processes: list[BaseProcess] = []
        if launched_by_torchrun():
            init_method = "env://"
        else:
            init_method = free_tcp_init_method()
            ctx = mp.get_context("spawn")
            for rank in range(1, self.size):
                proc = ctx.Process(target=worker, args=(rank, config, init_method), name=f"tp-rank-{rank}", daemon=True)
                proc.start()
                self.processes.append(proc)
        init_group(0, self.size, device, init_method)

    def start(self, num_kv_blocks: int) -> None:
        """After rank 0 has sized its KV cache: every rank allocates the same number of blocks."""
        self._send(("init", num_kv_blocks))  # received by receive_num_kv_blocks() on every worker

    def run_step(self, step: StepInput) -> None:
        self._send(("step", step))

    def write_lora_slot(self, slot: int, weights: LoRAAdapterWeights | None) -> None:
        self._send(("lora_write", slot, weights))

    def shutdown(self) -> None:
        try:
            if self._dead_rank() is None:
                shutdown: ShutdownMessage = ("shutdown",)
                broadcast_from_rank0(shutdown)
        finally:
            destroy_group()
            for proc in self.processes:
                proc.join(timeout=10)

    def _send(self, message: Message) -> None:
        dead = self._dead_rank()
        if dead is not None:
            raise EngineDeadError(f"tensor-parallel rank {dead[0]} died (exit code {dead[1]}); restart the engine")
        broadcast_from_rank0(message)

    def _dead_rank(self) -> tuple[int, int | None] | None:
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                return rank, proc.exitcode
        return None


def _receive() -> Message:
    """On a worker: the next message rank 0 broadcasts."""
    # cast: broadcast_from_rank0 carries any object; rank 0 broadcasts only Messages (TensorParallelGroup)
    return cast(Message, broadcast_from_rank0())


def receive_num_kv_blocks() -> int:
    """On a worker: the number of KV blocks rank 0 sized its cache to (TensorParallelGroup.start)."""
    message = _receive()
    assert message[0] == "init"
    return message[1]


def follow_rank0(
    forward: Callable[[StepInput], object], write_slot: Callable[[int, LoRAAdapterWeights | None], None] | None
) -> None:
    """On a worker: run each step and LoRA slot write rank 0 broadcasts, until it sends shutdown."""
    while True:
        message = _receive()
        if message[0] == "step":
            forward(message[1])
        elif message[0] == "lora_write":
            assert write_slot is not None, "rank 0 wrote a LoRA slot on an engine without LoRA"
            write_slot(message[1], message[2])
        elif message[0] == "shutdown":
            return
