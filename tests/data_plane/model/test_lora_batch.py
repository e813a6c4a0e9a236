"""LoRABatch's per-step routing: the groups it builds against the token slots they came from."""

from __future__ import annotations

import torch

from data_plane.model.lora_batch import LoRABatch

CPU = torch.device("cpu")


def test_routed_lists_every_adapter_token_once_with_equal_slots_side_by_side():
    token_slots = [3, 1, -1, 3, 0, 1, 2, 2, 2, -1, 0, 0, 2]  # 6 decode tokens, then prefill runs
    batch = LoRABatch.build(token_slots, 6, 8, CPU)
    index, slots = batch.routed(CPU)
    pairs = list(zip(index.tolist(), slots.tolist(), strict=True))
    assert sorted(pairs) == sorted((t, s) for t, s in enumerate(token_slots) if s >= 0)  # each once, its own slot
    decode = slots[:5].tolist()
    assert decode == sorted(decode)  # decode tokens grouped by slot: a run per adapter
    assert index[5:].tolist() == [6, 7, 8, 10, 11, 12]  # prefill segments in order, each contiguous
    assert batch.routed(CPU) is batch.routed(CPU)  # made once per step, shared by every layer
