"""Batched LoRA ops against a per-token loop written from the definition."""

from __future__ import annotations

import torch

from data_plane.lora.ops import lora_shrink_expand
from data_plane.model.lora_batch import LoRABatch

SLOTS, R, IN, OUTS = 3, 4, 16, (12, 5)  # two lanes, like gate/up
CPU = torch.device("cpu")
LANES = [(0, OUTS[0]), (OUTS[0], OUTS[1])]


def _weights(rank: int = R):
    """Slot weights zero-padded past `rank`, as the slot manager writes them."""
    g = torch.Generator().manual_seed(0)
    a = torch.zeros(SLOTS, IN, len(OUTS), R)  # input-major, lanes stacked along the rank axis
    a[..., :rank] = torch.randn(SLOTS, IN, len(OUTS), rank, generator=g)
    b = torch.zeros(SLOTS, R, sum(OUTS))  # lanes side by side along the output columns
    b[:, :rank] = torch.randn(SLOTS, rank, sum(OUTS), generator=g)
    return a.view(SLOTS, IN, len(OUTS) * R), b


def _reference(x, a, b, token_slots):
    """Lane l of token t: (x[t] @ A[s][:, lane l]) @ B[s][:, lane l's columns], one token at a time."""
    a = a.view(SLOTS, IN, len(OUTS), R)
    ys = [torch.zeros(x.shape[0], out) for out in OUTS]
    for t, s in enumerate(token_slots):
        if s >= 0:
            for lane, (offset, width) in enumerate(LANES):
                ys[lane][t] = (x[t] @ a[s, :, lane]) @ b[s, :, offset : offset + width]
    return ys


def _run(token_slots, num_decode, rank=R, weight_rank=R):
    a, b = _weights(weight_rank)
    x = torch.randn(len(token_slots), IN)
    y = torch.zeros(len(token_slots), sum(OUTS))
    batch = LoRABatch.build(token_slots, num_decode_tokens=num_decode, rank=rank, device=CPU)
    lora_shrink_expand(y, x, a, b, LANES, batch)
    return y, _reference(x, a, b, token_slots), batch


def test_mixed_decode_and_prefill_routes_every_token_to_its_slot():
    token_slots = [2, -1, 0, 2, 1, 1, 1, -1, -1, 0, 0]  # 4 decode tokens, then prefill segments
    y, (ref_gate, ref_up), _ = _run(token_slots, num_decode=4)
    torch.testing.assert_close(y, torch.cat([ref_gate, ref_up], dim=1), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[[1, 7, 8]], torch.zeros(3, sum(OUTS)))  # base tokens untouched, bit for bit


def test_single_adapter_fast_path_and_all_base():
    y, refs, batch = _run([1] * 5, num_decode=2)
    assert batch.single_slot == 1
    torch.testing.assert_close(y, torch.cat(refs, dim=1), atol=1e-5, rtol=1e-5)
    assert LoRABatch.build([-1] * 5, num_decode_tokens=2, rank=R, device=CPU) is None


def test_decode_tokens_all_routed_add_to_a_slice():
    y, refs, batch = _run([0, 2, 1, -1, 1], num_decode=3)
    assert batch.decode_contiguous
    torch.testing.assert_close(y, torch.cat(refs, dim=1), atol=1e-5, rtol=1e-5)


def test_rank_below_padding_skips_zero_columns_exactly():
    # adapters of rank 2 in slots padded to 4: using rank 2 gives the same result as the full padding
    token_slots = [0, 2, 1, 1, 1]
    y, refs, _ = _run(token_slots, num_decode=2, rank=2, weight_rank=2)
    torch.testing.assert_close(y, torch.cat(refs, dim=1), atol=1e-5, rtol=1e-5)
