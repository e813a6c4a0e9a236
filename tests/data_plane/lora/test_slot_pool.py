"""The slot pool: every layer's slots are views of one tensor, an adapter's image (made on any thread) is
exactly the PEFT weights padded with the scale folded in, and a write replaces a slot whole."""

from __future__ import annotations

import threading

import pytest
import torch

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.model.config import ModelConfig
from tests.data_plane.engine.conftest import make_engine

MAX_RANK = 32


@pytest.fixture(scope="module")
def setup(engine_checkpoints, peft_adapters):
    base = engine_checkpoints["llama"]
    config = ModelConfig.from_pretrained(base)
    load = lambda kind: load_peft_adapter(peft_adapters("llama", kind), config, max_rank=MAX_RANK,  # noqa: E731
                                          allowed_roots=[str(peft_adapters("llama", kind).parent)])
    return base, {kind: load(kind) for kind in ("rslora", "attention")}


def _lane(linear, name: str, slot: int):
    """(A [in, R], B [R, out_l]) of one lane of one slot, as the ops read them."""
    index = linear.lane_modules().index(name)
    lane = linear.lanes[index]
    return (linear.lora_a[slot, :, index * MAX_RANK : (index + 1) * MAX_RANK],
            linear.lora_b[slot, :, lane.offset : lane.offset + lane.size])


def test_slots_hold_the_peft_weights_padded_and_are_replaced_whole(setup):
    base, weights = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK)
    slots = engine.lora_slots
    pool = slots.pool.pool
    for linears in slots.layers:  # every layer's slots live in the one pool tensor
        for linear in linears:
            for buffer in (linear.lora_a, linear.lora_b):
                assert buffer.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()

    rslora = weights["rslora"]  # rank 16 on the MLP
    prepared = threading.Thread(target=slots.prepare, args=(rslora,))  # off the step loop
    prepared.start()
    prepared.join()
    slots.pin(1, rslora, busy=set())
    slot = slots.slot(1)
    gate_up = slots.layers[0][2]
    module = rslora.layers[0]["up_proj"]
    a, b = _lane(gate_up, "up_proj", slot)
    assert torch.equal(a[:, : module.rank], module.a_t) and not a[:, module.rank :].any()
    assert torch.equal(b[: module.rank], module.b_t * module.scaling) and not b[module.rank :].any()
    assert not slots.layers[0][0].lora_a[slot].any()  # q/k/v: not targeted, zero

    # a rank-4 attention adapter takes the same slot: nothing of the rank-16 MLP weights remains
    slots.remove(1)
    assert not pool[slot].any()
    attention = weights["attention"]
    slots.pin(2, attention, busy=set())
    assert slots.slot(2) == slot and slots.slot_rank[slot] == attention.description.rank
    assert not gate_up.lora_a[slot].any() and not gate_up.lora_b[slot].any()
    q = attention.layers[1]["q_proj"]
    a, b = _lane(slots.layers[1][0], "q_proj", slot)
    assert torch.equal(a[:, : q.rank], q.a_t) and torch.equal(b[: q.rank], q.b_t * q.scaling)


def test_images_are_kept_by_content_and_bounded(setup):
    base, weights = setup
    engine = make_engine(base, enable_lora=True, max_loras=1, max_lora_rank=MAX_RANK)
    pool = engine.lora_slots.pool
    image = pool.prepare(weights["rslora"])
    assert pool.prepare(weights["rslora"]) is image  # a second load is one copy of the kept image
    pool.prepare(weights["attention"])  # one image kept per slot: the older one goes
    assert pool.prepare(weights["rslora"]) is not image
    torch.testing.assert_close(pool.prepare(weights["rslora"]), image, rtol=0, atol=0)
