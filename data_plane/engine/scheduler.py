"""Continuous batching: every step decodes all running sequences and admits waiting prompts.

Admission stays within the free KV blocks, the token budget (`max_num_batched_tokens`) and the
sequence cap (`max_num_seqs`). When a running sequence needs a KV block and none is free, the most
recently admitted running sequence (of the group furthest over its fair share, if one is) is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed (its prefix
blocks are often still cached).

Fair share (fair_share.py): one API request (a group: a completion's prompts x n) may not hold the batch
while others wait. Its share is max_num_seqs seats and num_blocks KV blocks over the groups with
sequences running or waiting (at least 1). Waiting sequences within their group's share are admitted
first, in arrival order; the others after them, the group with the fewest ahead first. When a waiting
sequence within its share finds every seat taken (or the first of them too few KV blocks), the newest
running sequence of the group furthest over its share is preempted for it, after the decodes took the KV
blocks they need (what it frees is left for the sequence it was preempted for). So a request that
arrives while another fills the batch is admitted at the next step; if its prompt fits what that step's
token budget leaves, its first token comes in that step.

Chunked prefill (`enable_chunked_prefill`, vLLM's): a prompt longer than what is left of the step's
token budget is computed a chunk per step, beside the running decodes, instead of waiting for a step
of its own that would stall them. Each step spends the budget in this order:

    1. one token for every decoding sequence (len(seq) - num_computed_tokens == 1)
    2. the next chunk of every running prefill within its group's share, oldest first
    3. waiting sequences (the admission passes below), in the fair order; the last one admitted may get
       a partial chunk. While prefills beyond their share still run, only those within their share
    4. the next chunk of every running prefill beyond its group's share, oldest first

While sequences decode, prompts longer than `long_prefill_tokens` (LONG_PREFILL_TOKENS unless
--long-prefill-token-threshold says otherwise; 0: every prompt) share a part of the budget that
the prefill pacer (prefill_pacer.py, `--decode-stall-limit`) sizes from measured step times, so that
the decodes' steps stay within the stall limit; a long prompt then takes more, cheaper steps.

A sequence gets KV blocks for its whole prompt when it is admitted, so a prefill in progress never
needs a block mid-way; it samples its first token in the step whose chunk reaches its last token.
Without chunking a prompt is admitted only when all its new tokens fit the budget left.

With LoRA, an adapter's sequence can run only while the adapter holds one of the few device slots.
So that one load serves every waiting request of an adapter, admission goes in two passes over the
waiting queue, each in the fair order:

    pass 1: sequences of the base model and of adapters in a slot now; it stops at the first sequence
            beyond its share once it passed one within its share whose adapter a slot can take now
    pass 2: the others, up to where pass 1 stopped; the first of an adapter loads it into a free slot
            or one whose adapter is not busy (the coldest: slots.py), and its later arrivals join it

An adapter with a sequence admitted this step is busy, so pass 2 never evicts an adapter that pass 1
just gave work. A sequence refused room (blocks, budget, cap) ends its pass and pass 2 stops where pass
1 did: no sequence takes room that one before it was refused in the step.

Bounded waiting: in pass 1 later sequences pass a head of the fair order whose adapter has no slot. Once
the head has waited `max_slot_wait_steps` steps it is admitted first, before both passes. Refused room, it
stops all admission (first come, first served, as without LoRA). Refused a slot (every one is pinned
or busy), the busy unpinned adapter with the fewest running sequences is drained, and of those the
one whose slot frees soonest (its running sequences have the fewest tokens left to generate: a stop
may end them sooner, but none runs longer): none of its sequences is admitted until the head has
started, so its slot frees once those end and the head, tried first, takes it.

An adapter whose slot image is still being made on the image thread (its request came while sequences
ran: slot_pool.py) is not loaded while sequences run; its requests wait the step or two that takes,
and a head that has waited its bounded steps loads it anyway, making the image in the step.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_share import FairShare
from data_plane.engine.prefill_pacer import LONG_PREFILL_TOKENS, PrefillPacer
from data_plane.engine.sequence import Sequence, SequenceStatus
from data_plane.lora.slots import LoRASlotManager
from data_plane.lora.weights import LoRAAdapterWeights

MAX_SLOT_WAIT_STEPS = 16  # steps the head of the queue may be passed before it is admitted first


class _Verdict(enum.Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no_room"  # KV blocks, token budget or sequence cap
    NO_SLOT = "no_slot"  # every LoRA slot holds a pinned or busy adapter
    NOT_RESIDENT = "not_resident"  # its adapter has no slot and this pass loads none


class _LongPrefillShare:
    """Tokens of long prompts this step may still compute beside its decodes (prefill_pacer.py). The
    pacer is asked once a step, and only when a long prompt is scheduled: it grows its share only over
    steps that use it."""

    def __init__(self, pacer: PrefillPacer | None, num_decodes: int, long_tokens: int, num_long: int) -> None:
        self._pacer = pacer if num_decodes else None  # nothing to stall without decodes
        self._num_decodes = num_decodes
        self._long_tokens = long_tokens  # a prompt of more tokens than this is long
        self._num_long = num_long  # long prompts waiting or prefilling
        self._left: int | None = None

    def cap(self, seq: Sequence, num_new: int) -> int:
        """How many of `num_new` tokens of `seq`'s prefill this step may compute."""
        if self._pacer is None or len(seq) <= self._long_tokens:
            return num_new
        if self._left is None:
            self._left = self._pacer.long_prefill_budget(self._num_decodes, self._num_long)
        return min(num_new, self._left)

    def spend(self, seq: Sequence, num_new: int) -> None:
        if self._left is not None and len(seq) > self._long_tokens:
            self._left -= num_new


@dataclass
class _Admission:
    """One step's admission, shared by its passes."""

    token_budget: int
    long_share: _LongPrefillShare
    busy: set[int]  # adapters of running and admitted sequences: their slots are not evicted
    held_back: int | None = None  # the adapter drained for an overdue head
    admitted: set[int] = field(default_factory=set)  # seq ids


@dataclass
class ScheduledPrefill:
    seq: Sequence
    # tokens computed this step, from seq.num_computed_tokens on: all those not served by the prefix
    # cache, or the next chunk of them
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits are sampled (read before the step
        advances num_computed_tokens)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


def steps_left(seq: Sequence) -> int:
    """The most steps `seq` may still run: its tokens to go (a stop or EOS may end it sooner)."""
    return seq.sampling_params.max_tokens - len(seq.output_token_ids)


def _adapter_weights(seq: Sequence) -> LoRAAdapterWeights:
    """The weights of an adapter's sequence (adapter id > 0): LLMEngine.validate admits none without."""
    lora = seq.request.lora
    assert lora is not None, f"adapter {seq.adapter_id}'s sequence has no weights"
    return lora


def is_prefilling(seq: Sequence) -> bool:
    """A running sequence with more than one token left to compute: a chunked prefill in progress."""
    return len(seq) - seq.num_computed_tokens > 1


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
        max_slot_wait_steps: int = MAX_SLOT_WAIT_STEPS,
        enable_chunked_prefill: bool = False,
        prefill_pacer: PrefillPacer | None = None,
        long_prefill_tokens: int = LONG_PREFILL_TOKENS,
    ) -> None:
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_slot_wait_steps = max_slot_wait_steps
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_pacer = prefill_pacer if enable_chunked_prefill else None
        self.long_prefill_tokens = long_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # steps each head of the queue waited (kept when a preempted sequence goes in front of it)
        self._waited: dict[int, int] = {}
        self._drained: tuple[int, int] | None = None  # (overdue head's seq id, adapter held back for it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _slots(self) -> LoRASlotManager:
        """The LoRA slots, asked about adapters' sequences only: LLMEngine.validate admits those only on an
        engine with LoRA."""
        assert self.lora_slots is not None, "an adapter's sequence on an engine without LoRA"
        return self.lora_slots

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        if self.waiting:
            self._make_room(out, self._fair_share())  # after the decodes took the blocks they need
        prefills = [seq for seq in self.running if is_prefilling(seq)]
        if not prefills and not self.waiting:
            return out
        fair = self._fair_share()  # after the step's preemptions
        num_long = sum(len(seq) > self.long_prefill_tokens for seq in (*prefills, *self.waiting))
        long_share = _LongPrefillShare(self.prefill_pacer, len(out.decodes), self.long_prefill_tokens, num_long)
        beyond = [seq for seq in prefills if not fair.within(seq)]
        token_budget = self.max_num_batched_tokens - len(out.decodes)
        token_budget = self._continue_prefills(out, [s for s in prefills if fair.within(s)], token_budget, long_share)
        token_budget = self._admit_waiting(out, token_budget, long_share, fair, within_only=bool(beyond))
        self._continue_prefills(out, beyond, token_budget, long_share)
        return out

    def _fair_share(self) -> FairShare:
        return FairShare.of(self.running, self.waiting, self.max_num_seqs, self.block_manager.num_blocks)

    def _make_room(self, out: SchedulerOutput, fair: FairShare) -> None:
        """Preempt sequences of groups over their share (a decode scheduled this step included) for the
        waiting ones within theirs that find every seat taken (or, the first of them, too few free KV
        blocks), so that no request waits for room another holds beyond its share. Only for those this
        step can admit as far as their adapter goes."""
        busy = {seq.adapter_id for seq in self.running}
        entitled = [seq for seq in fair.order(self.waiting) if fair.within(seq) and self._admissible(seq, busy)]
        seats = self.max_num_seqs - len(self.running)
        for index, seq in enumerate(entitled):
            while seats <= 0 or (index == 0 and self.block_manager.plan_allocation(seq) is None):
                victim = fair.victim(self.running)
                if victim is None:
                    return
                self.running.remove(victim)
                out.decodes = [s for s in out.decodes if s is not victim]
                fair.preempted(victim)
                self._preempt(victim)
                seats += 1
            seats -= 1

    def _admissible(self, seq: Sequence, busy: set[int]) -> bool:
        """Whether its adapter lets this step admit it: none, one in a slot, or one a slot can take now."""
        if seq.adapter_id == 0 or self._slots().is_resident(seq.adapter_id):
            return True
        slots = self._slots()
        return slots.can_load(busy) and not (self.running and slots.image_pending(_adapter_weights(seq)))

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        running: list[Sequence] = []
        queue = list(self.running)
        fair: FairShare | None = None  # made when a decode first finds no KV block
        while queue:
            seq = queue.pop(0)
            if is_prefilling(seq):  # it holds blocks for its whole prompt: nothing to append
                running.append(seq)
                continue
            while not self.block_manager.can_append_slot(seq):
                fair = fair or self._fair_share()
                # the newest of the group furthest over its share, else the newest
                victim = fair.victim([seq, *queue]) or (queue[-1] if queue else seq)
                if victim is not seq:
                    queue = [s for s in queue if s is not victim]
                fair.preempted(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                running.append(seq)
                out.decodes.append(seq)
        self.running = running

    def _continue_prefills(self, out: SchedulerOutput, seqs: list[Sequence], token_budget: int,
                           long_share: _LongPrefillShare) -> int:
        """The next chunk of each of these running prefills, oldest first, within the budget and the long
        prompts' share; answers what is left of the budget."""
        for seq in seqs:
            if token_budget <= 0:
                break
            chunk = long_share.cap(seq, min(len(seq) - seq.num_computed_tokens, token_budget))
            if chunk <= 0:
                continue  # the long prompts' share is spent; shorter prefills behind may still run
            out.prefills.append(ScheduledPrefill(seq, chunk))
            long_share.spend(seq, chunk)
            token_budget -= chunk
        return token_budget

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int, long_share: _LongPrefillShare,
                       fair: FairShare, within_only: bool) -> int:
        """Admit waiting sequences in the fair order (fair_share.py), only those within their group's share
        while prefills beyond theirs still run; answers what is left of the budget."""
        queue = [seq for seq in fair.order(self.waiting) if fair.within(seq) or not within_only]
        if not queue:
            return token_budget
        step = _Admission(token_budget, long_share, {s.adapter_id for s in self.running})
        head = queue[0]
        load = True
        if self._waited.get(head.seq_id, 0) >= self.max_slot_wait_steps:
            verdict = self._admit(out, step, head, load=True, forced=True)
            if verdict is _Verdict.NO_ROOM:
                return step.token_budget
            if verdict is _Verdict.NO_SLOT:
                step.held_back = self._held_back(head)
                load = False  # no slot frees within the step: a later load would find none either
        queue = [s for s in queue if s.seq_id not in step.admitted]
        stop = self._admission_pass(out, step, queue, load=False, fair=fair)
        if load:
            self._admission_pass(out, step, queue[:stop], load=True, fair=fair)
        if step.admitted:
            self.waiting = deque(s for s in self.waiting if s.seq_id not in step.admitted)
        if head.seq_id not in step.admitted:
            self._waited[head.seq_id] = self._waited.get(head.seq_id, 0) + 1
        return step.token_budget

    def _admission_pass(self, out: SchedulerOutput, step: _Admission, queue: list[Sequence], load: bool,
                        fair: FairShare) -> int:
        """Admit what this pass may of `queue`; answers where it stopped: at a sequence refused room, or at
        the first beyond its share after one within its share passed over for a slot that pass 2 can load."""
        passed = False
        for index, seq in enumerate(queue):
            if passed and not fair.within(seq):
                return index
            if seq.seq_id in step.admitted or seq.adapter_id == step.held_back:
                continue
            verdict = self._admit(out, step, seq, load)
            if verdict is _Verdict.NO_ROOM:
                return index
            if verdict is _Verdict.NO_SLOT:
                load = False  # every slot is pinned or busy until the step ends
            if verdict is _Verdict.NOT_RESIDENT and fair.within(seq) and self._admissible(seq, step.busy):
                passed = True
        return len(queue)

    def _admit(self, out: SchedulerOutput, step: _Admission, seq: Sequence, load: bool, forced: bool = False) -> _Verdict:
        adapter = seq.adapter_id
        resident = adapter == 0 or self._slots().is_resident(adapter)
        if not resident and not load:
            return _Verdict.NOT_RESIDENT
        if not resident and not forced and self.running and self._slots().image_pending(_adapter_weights(seq)):
            return _Verdict.NOT_RESIDENT  # its slot image is being made beside the running steps (slot_pool.py)
        num_new = self.block_manager.plan_allocation(seq)
        if len(self.running) >= self.max_num_seqs or num_new is None:
            return _Verdict.NO_ROOM
        if self.enable_chunked_prefill:  # the first chunk; the rest in later steps
            num_new = step.long_share.cap(seq, min(num_new, step.token_budget))
        if num_new <= 0 or num_new > step.token_budget:
            return _Verdict.NO_ROOM
        if not resident and not self._slots().ensure_resident(adapter, _adapter_weights(seq), step.busy):
            return _Verdict.NO_SLOT
        if adapter:
            step.busy.add(adapter)
            self._slots().use(adapter)
        self.block_manager.allocate(seq)
        step.token_budget -= num_new
        step.long_share.spend(seq, num_new)
        step.admitted.add(seq.seq_id)
        self._waited.pop(seq.seq_id, None)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.prefills.append(ScheduledPrefill(seq, num_new))
        return _Verdict.ADMITTED

    def _held_back(self, head: Sequence) -> int | None:
        """The adapter drained for an overdue head: the busy unpinned one with the fewest running
        sequences (draining a busy adapter would hold back its work and then cost it its slot), and
        among those the one whose slot frees soonest (the fewest steps its longest running sequence may
        still take), kept while the head is the same and it still holds a slot that could free."""
        running: dict[int, list[Sequence]] = {}
        for seq in self.running:
            if seq.adapter_id and not self._slots().is_pinned(seq.adapter_id):
                running.setdefault(seq.adapter_id, []).append(seq)
        if self._drained is None or self._drained[0] != head.seq_id or self._drained[1] not in running:
            def cost(adapter: int) -> tuple[int, int, int]:  # the work held back, then the head's wait
                return len(running[adapter]), max(map(steps_left, running[adapter])), adapter

            self._drained = (head.seq_id, min(running, key=cost)) if running else None
        return self._drained[1] if self._drained else None

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
            self._waited.pop(seq.seq_id, None)
        self.block_manager.free_seq(seq)
