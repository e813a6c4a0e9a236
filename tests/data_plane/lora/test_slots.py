"""Device slots: the coldest evictable adapter goes (a hot one keeps its slot against a one-off, and cools
down once unused); pinned and busy adapters never go; heat outlives an eviction and ends with a removal.

A real LoRASlotManager without layers: slot writes copy nothing, the choice of slots is what is tested.
"""

from __future__ import annotations

from data_plane.lora.slots import HEAT_HALF_LIFE, LoRASlotManager
from data_plane.lora.weights import LoRAAdapterWeights
from shared.engine_admin import AdapterDescription


def _weights(adapter_id: int) -> LoRAAdapterWeights:
    description = AdapterDescription(sha256=f"{adapter_id:064x}", rank=4, alpha=8.0, target_modules=["q_proj"],
                                     size_bytes=0)
    return LoRAAdapterWeights(path=f"/adapters/{adapter_id}", description=description)


def _admit(slots: LoRASlotManager, adapter_id: int, busy: frozenset[int] = frozenset()) -> bool:
    """What the scheduler does when it admits a sequence of the adapter."""
    if not slots.ensure_resident(adapter_id, _weights(adapter_id), set(busy)):
        return False
    slots.use(adapter_id)
    return True


def test_a_hot_adapter_keeps_its_slot_against_a_one_off():
    slots = LoRASlotManager([], max_loras=2)
    for _ in range(8):
        _admit(slots, 1)  # hot
    _admit(slots, 2)  # once, and used after the hot one: least recently used would evict 1
    _admit(slots, 3)
    assert slots.is_resident(1) and not slots.is_resident(2)
    assert slots.stats[2].evictions == 1 and slots.stats[1].evictions == 0


def test_a_hot_adapter_that_goes_unused_cools_down_and_is_evicted():
    slots = LoRASlotManager([], max_loras=2)
    for _ in range(8):
        _admit(slots, 1)
    for _ in range(int(5 * HEAT_HALF_LIFE)):  # adapter 2 alone for five half-lives: 8 uses become 0.25
        _admit(slots, 2)
    _admit(slots, 3)
    assert not slots.is_resident(1) and slots.is_resident(2) and slots.is_resident(3)


def test_equal_heat_goes_to_the_least_recently_used():
    slots = LoRASlotManager([], max_loras=2)
    _admit(slots, 1)
    _admit(slots, 2)
    _admit(slots, 3)  # 1 and 2 were used once each; 1 longer ago (and cooler by then)
    assert not slots.is_resident(1) and slots.is_resident(2)


def test_pinned_and_busy_adapters_are_never_evicted():
    slots = LoRASlotManager([], max_loras=2)
    slots.pin(1, _weights(1), set())
    _admit(slots, 2)
    for _ in range(8):
        _admit(slots, 3, busy=frozenset({2}))  # every slot pinned or busy: wait
    assert not slots.is_resident(3) and slots.is_resident(1) and slots.is_resident(2)
    slots.unpin(1)  # never used, so the coldest now
    assert _admit(slots, 3, busy=frozenset({2})) and not slots.is_resident(1)


def test_heat_outlives_an_eviction_and_ends_with_a_removal():
    slots = LoRASlotManager([], max_loras=1)
    for _ in range(4):
        _admit(slots, 1)
    _admit(slots, 2)  # evicts 1, which stays hot
    assert slots.heat[1][0] > slots.heat[2][0] > 0
    slots.remove(1)
    assert 1 not in slots.heat and 1 not in slots.stats
