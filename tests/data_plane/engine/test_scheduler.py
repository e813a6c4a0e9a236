"""The scheduler with LoRA slots: one load serves every waiting request of an adapter, an adapter with work
keeps its slot, the head of the queue is admitted within the bound, nothing passes a sequence refused room.
The fair share: a request that fills the batch gives a seat up to one that arrives beside it at the next step,
sequences beyond their request's share wait behind other requests' when seats or the token budget bind.

The scheduler runs on a real BlockManager and a real LoRASlotManager without layers (slot writes copy
nothing), driven as the engine drives it: schedule a step, grow or finish its sequences, repeat.
"""

from __future__ import annotations

from data_plane.engine.block_manager import BlockManager
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.scheduler import Scheduler, SchedulerOutput
from data_plane.engine.sequence import Request, Sequence
from data_plane.lora.slots import LoRASlotManager
from data_plane.lora.weights import LoRAAdapterWeights
from shared.engine_admin import AdapterDescription

PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _weights(adapter_id: int) -> LoRAAdapterWeights:
    description = AdapterDescription(sha256=f"{adapter_id:064x}", rank=4, alpha=8.0, target_modules=["q_proj"],
                                     size_bytes=0)
    return LoRAAdapterWeights(path=f"/adapters/{adapter_id}", description=description)


class Drive:
    """A scheduler, its sequences by name, and a check of every step it schedules."""

    def __init__(self, *, max_loras: int = 2, num_blocks: int = 256, max_num_seqs: int = 64, wait: int = 4,
                 budget: int = 2048) -> None:
        self.slots = LoRASlotManager([], max_loras)
        self.blocks = BlockManager(num_blocks, block_size=4)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget, self.slots, max_slot_wait_steps=wait)
        self.seqs: dict[str, Sequence] = {}
        self.steps_left: dict[str, int] = {}  # sequences that finish after running this many more steps

    def add(self, name: str, adapter_id: int, prompt_len: int = 4, steps: int | None = None, group: str = "") -> Sequence:
        """Queue a sequence; with `steps`, it finishes after running that many steps; `group`: the API
        request it is a prompt of (none: a request of its own)."""
        request = Request(name, list(range(1, prompt_len + 1)), PARAMS, adapter_id=adapter_id,
                          prefix_hash_seed=adapter_id, lora=_weights(adapter_id) if adapter_id else None,
                          group_id=group)
        seq = self.seqs[name] = Sequence(len(self.seqs), request, 0)
        if steps is not None:
            self.steps_left[name] = steps
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[str]:
        """One step; answers the names admitted in it. Every sequence that runs has its adapter in a slot."""
        out: SchedulerOutput = self.scheduler.schedule()
        for seq in out.decodes + [p.seq for p in out.prefills]:
            if seq.adapter_id:
                assert self.slots.slot_owner[self.slots.slot(seq.adapter_id)] == seq.adapter_id
            seq.num_computed_tokens = len(seq)
            name = seq.request.request_id
            if name in self.steps_left:
                self.steps_left[name] -= 1
                if not self.steps_left[name]:
                    self.finish(name)
        return [p.seq.request.request_id for p in out.prefills]

    def finish(self, *names: str) -> None:
        for name in names:
            self.scheduler.remove(self.seqs[name])

    def loads(self, adapter_id: int) -> int:
        return self.slots.stats[adapter_id].loads


def test_one_load_serves_every_waiting_request_of_an_adapter():
    d = Drive(max_loras=1)
    for name, adapter in [("a1", 1), ("b1", 2), ("base", 0), ("a2", 1), ("b2", 2), ("a3", 1), ("b3", 2)]:
        d.add(name, adapter)
    # a1 loads adapter 1 and a2, a3 join it; the b's wait for the one slot; the base model needs none
    assert d.step() == ["base", "a1", "a2", "a3"]
    assert d.step() == []
    d.finish("a1", "a2", "a3")
    assert d.step() == ["b1", "b2", "b3"]
    assert d.loads(1) == d.loads(2) == 1  # first come, first served would have loaded six times


def test_a_resident_adapter_with_waiting_work_is_not_evicted_for_an_earlier_arrival():
    d = Drive(max_loras=2)
    d.add("a1", 1)
    d.add("c1", 3)
    assert d.step() == ["a1", "c1"]
    d.finish("a1", "c1")
    d.add("b1", 2)  # arrives first, but adapters 1 and 3 are in the slots and have requests too
    d.add("a2", 1)
    assert d.step() == ["a2", "b1"]  # a2 makes adapter 1 busy; b1 takes adapter 3's slot, not 1's
    assert d.slots.is_resident(1) and d.slots.is_resident(2) and not d.slots.is_resident(3)


def test_the_head_waiting_for_a_slot_is_admitted_within_the_bound():
    wait, run_steps = 4, 3
    d = Drive(max_loras=1, wait=wait)
    d.add("a0", 1, steps=run_steps)
    assert d.step() == ["a0"]
    d.add("b", 2)  # the one slot is busy with adapter 1, which gets a new request every step
    passed = 0
    for step in range(1, 40):
        d.add(f"a{step}", 1, steps=run_steps)
        admitted = d.step()
        if "b" in admitted:
            break
        passed += len(admitted)
    else:
        raise AssertionError("the head of the queue was never admitted")
    assert passed > 0  # later requests of the resident adapter passed it meanwhile
    # the bound, then adapter 1 drained (none of its new requests admitted) until b has its slot
    assert step <= wait + run_steps
    assert d.loads(2) == 1 and d.slots.stats[1].evictions == 1


def test_nothing_is_admitted_past_a_sequence_refused_room():
    d = Drive(max_loras=2, num_blocks=12)  # 11 blocks usable (one is the watermark)
    d.add("a0", 1, prompt_len=24)  # 6 blocks
    assert d.step() == ["a0"]
    d.add("b", 2, prompt_len=4)  # not resident, 1 block: fits
    d.add("a_big", 1, prompt_len=24)  # resident, 6 blocks: does not fit the 5 usable
    d.add("a_small", 1, prompt_len=4)  # resident, 1 block: would fit, but arrived after a_big
    assert d.step() == ["b"]
    d.finish("a0")
    assert d.step() == ["a_big", "a_small"]


def test_a_preempted_sequence_keeps_its_adapter_slot_while_it_waits_for_room():
    d = Drive(max_loras=2, num_blocks=9)  # 8 blocks usable
    d.add("a1", 1, prompt_len=16)  # 4 blocks, full
    d.add("c1", 3, prompt_len=16)  # 4 blocks, full
    assert d.step() == ["a1", "c1"]
    d.add("b1", 2, prompt_len=2)  # waits: both slots busy
    for name in ("a1", "c1"):
        d.seqs[name].output_token_ids.append(7)  # each needs a fifth block; one is left
    assert d.step() == []  # c1, admitted last, is preempted; it goes back to the front and does not fit
    assert d.scheduler.num_preemptions == 1 and d.scheduler.waiting[0] is d.seqs["c1"]
    assert d.slots.is_resident(3)  # b1 (which would fit) did not pass c1 nor take adapter 3's idle slot
    d.finish("a1")
    assert d.step() == ["c1", "b1"]


def test_an_overdue_head_never_drains_a_pinned_adapter():
    d = Drive(max_loras=2, wait=2)
    d.slots.pin(5, _weights(5), set())
    d.add("p0", 5)  # the pinned adapter runs one request that does not end: draining it would never free
    d.add("a0", 1, steps=2)
    d.add("a1", 1, steps=2)
    assert d.step() == ["p0", "a0", "a1"]
    d.add("b", 2)  # adapter 1 always has two running (more than the pinned one) and one waiting
    for step in range(2, 30):
        d.add(f"a{step}", 1, steps=2)
        if "b" in d.step():
            break
    else:
        raise AssertionError("the head of the queue was never admitted")
    assert d.slots.is_resident(5) and d.slots.stats[1].evictions == 1 and d.loads(2) == 1


def test_an_overdue_head_is_admitted_when_resident_adapters_fill_every_seat():
    wait = 3
    d = Drive(max_loras=2, max_num_seqs=4, wait=wait)
    d.add("a0", 1, steps=3)
    d.add("c0", 3, steps=2)
    assert d.step() == ["a0", "c0"]
    d.add("b", 2)  # both slots busy; adapters 1 and 3 alone would take every seat, step after step
    for step in range(1, 40):
        for k in range(2):
            d.add(f"a{step}-{k}", 1, steps=3)
        d.add(f"c{step}", 3, steps=2)
        if "b" in d.step():
            break
    else:
        raise AssertionError("the head of the queue was never admitted")
    # overdue after `wait` steps; then a drained adapter's slot frees (3 steps at most) and a seat (3 more)
    assert step <= wait + 2 * 3 + 1


def test_an_overdue_head_drains_of_the_least_busy_adapters_the_one_whose_slot_frees_soonest():
    d = Drive(max_loras=3, wait=1)
    d.add("a0", 1)  # one sequence, just started: 64 tokens to go
    d.add("c0", 3)  # one sequence, 2 tokens from its max_tokens
    d.add("e0", 4)  # two sequences, 1 token from their end: busier, so not drained
    d.add("e1", 4)
    assert d.step() == ["a0", "c0", "e0", "e1"]
    d.seqs["c0"].output_token_ids.extend([7] * (PARAMS.max_tokens - 2))
    for name in ("e0", "e1"):
        d.seqs[name].output_token_ids.extend([7] * (PARAMS.max_tokens - 1))
    d.add("b", 2)
    d.step()  # b waits its one step
    d.add("a1", 1)
    d.add("c1", 3)
    d.add("e2", 4)
    # adapters 1 and 3 run one sequence each; draining 1 would hold b for 64 steps, 3 frees in 2
    assert d.step() == ["a1", "e2"]
    d.finish("c0")
    assert d.step() == ["b"]  # into adapter 3's slot; c1 waits for one
    assert d.slots.is_resident(1) and d.slots.is_resident(4) and d.slots.stats[3].evictions == 1


def test_a_request_that_fills_the_batch_gives_a_seat_to_one_arriving_beside_it_at_the_next_step():
    d = Drive(max_num_seqs=8)
    for i in range(12):  # one API request of 12 prompts: more than the batch holds
        d.add(f"big{i}", 0, group="big")
    assert d.step() == [f"big{i}" for i in range(8)]
    for _ in range(3):
        assert d.step() == []  # the batch is full; big8 and later wait
    d.add("small", 0)
    assert d.step() == ["small"]  # its share is 8 // 2 = 4: the newest of big's 8 gave its seat up
    assert d.scheduler.num_preemptions == 1 and list(d.scheduler.waiting)[0] is d.seqs["big7"]
    assert d.step() == []  # big7 is beyond its share: it does not take the seat back
    d.finish("small")
    assert d.step() == ["big7"]  # alone again, big has the whole batch as its share


def test_sequences_beyond_their_share_wait_behind_other_requests():
    d = Drive(max_num_seqs=6)
    for i in range(8):
        d.add(f"big{i}", 0, group="big")
    d.add("a", 0)
    d.add("b", 0)
    # three requests share 6 seats, 2 each: big's third and later come after a and b
    assert d.step() == ["big0", "big1", "a", "b", "big2", "big3"]


def test_when_the_token_budget_binds_a_new_request_goes_before_prompts_beyond_a_share():
    d = Drive(max_num_seqs=4, budget=16)
    for i in range(6):
        d.add(f"big{i}", 0, prompt_len=8, group="big")
    assert d.step() == ["big0", "big1"]  # 16 tokens: the budget
    d.add("small", 0, prompt_len=4)
    # 2 decodes leave 14 tokens; small (within its share of 2) before big2 (beyond big's), and big3 does not fit
    assert d.step() == ["small", "big2"]
    assert d.scheduler.num_preemptions == 0  # a seat was free: nothing was preempted


def test_a_request_within_its_share_that_needs_a_slot_is_not_passed_by_sequences_beyond_theirs():
    d = Drive(max_loras=2, max_num_seqs=4)
    for i in range(6):
        d.add(f"a{i}", 1, group="a")
    assert d.step() == ["a0", "a1", "a2", "a3"]
    d.add("b", 2)  # its adapter has no slot yet, but a free one can take it
    assert d.step() == ["b"]  # a3 gave its seat up, and a3, a4, a5 (beyond a's share of 2) did not take it
    assert d.slots.is_resident(2) and d.scheduler.num_preemptions == 1
    assert d.step() == [] and d.scheduler.num_preemptions == 1  # and nobody is preempted again


def test_a_request_that_holds_the_kv_cache_gives_blocks_up_to_one_arriving_beside_it():
    d = Drive(num_blocks=13)  # 12 usable (one is the watermark)
    for i in range(8):
        d.add(f"big{i}", 0, prompt_len=6, group="big")  # 2 blocks each
    assert d.step() == [f"big{i}" for i in range(6)]  # every usable block
    d.add("small", 0)  # 1 block, and none is free
    assert d.step() == ["small"]  # big held 12 blocks, over its share of 13 // 2: its newest gave its 2 up
    assert d.scheduler.num_preemptions == 1 and list(d.scheduler.waiting)[0] is d.seqs["big5"]


def test_a_request_over_its_share_keeps_one_sequence_running():
    d = Drive(num_blocks=9)  # 8 usable
    d.add("long", 0, prompt_len=32, group="long")  # every usable block
    assert d.step() == ["long"]
    d.add("small", 0)
    assert d.step() == [] and d.scheduler.num_preemptions == 0  # over its share of blocks, but its only one


def test_the_blocks_a_request_over_its_share_gives_up_are_left_to_the_one_it_gave_them_up_for():
    d = Drive(num_blocks=13)  # 12 usable
    for i in range(6):
        d.add(f"big{i}", 0, prompt_len=8, group="big")  # 2 full blocks each
    assert d.step() == [f"big{i}" for i in range(6)]
    for i in range(6):
        d.seqs[f"big{i}"].output_token_ids.append(7)  # each decode now needs a third block
    d.add("small", 0)
    assert d.step() == ["small"]  # the decodes' preemptions came first; what was freed for small stayed free
    assert "small" in [seq.request.request_id for seq in d.scheduler.running]
