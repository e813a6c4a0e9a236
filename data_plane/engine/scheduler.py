"""Continuous batching: every step decodes all running sequences and admits waiting prompts.

Admission is first come, first served within the token budget (`max_num_batched_tokens`) and the
sequence cap (`max_num_seqs`). When a running sequence needs a KV block and none is free, the most
recently admitted running sequence is preempted: its blocks are freed and it goes back to the front
of the waiting queue, to be recomputed (its prefix blocks are often still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sequence import Sequence, SequenceStatus
from data_plane.lora.slots import LoRASlotManager


@dataclass
class ScheduledPrefill:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step (those not served by the prefix cache)


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[ScheduledPrefill] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_slots: LoRASlotManager | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        self._admit_waiting(out, token_budget=self.max_num_batched_tokens - len(out.decodes))
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        running: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append_slot(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                running.append(seq)
                out.decodes.append(seq)
        self.running = running

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self.block_manager.plan_allocation(seq)
            if num_new is None or num_new > token_budget or not self._adapter_resident(seq):
                break  # first come, first served: later arrivals wait behind the head, so none starves
            self.block_manager.allocate(seq)
            token_budget -= num_new
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledPrefill(seq, num_new))

    def _adapter_resident(self, seq: Sequence) -> bool:
        """Base sequences need nothing; an adapter's needs a device slot (loaded now if one can be freed)."""
        if seq.adapter_id == 0:
            return True
        busy = {s.adapter_id for s in self.running}
        return self.lora_slots.ensure_resident(seq.adapter_id, seq.request.lora, busy)

    def adapter_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Running and waiting sequences per adapter id."""
        running: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for seq in self.running:
            running[seq.adapter_id] = running.get(seq.adapter_id, 0) + 1
        for seq in self.waiting:
            waiting[seq.adapter_id] = waiting.get(seq.adapter_id, 0) + 1
        return running, waiting

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
