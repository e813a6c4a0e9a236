"""Batched LoRA ops against a per-token loop written from the definition."""

from __future__ import annotations

import torch

from data_plane.lora.batch import LoRABatch
from data_plane.lora.ops import lora_add

SLOTS, R, IN, OUT = 3, 4, 16, 12


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(SLOTS, R, IN, generator=g), torch.randn(SLOTS, OUT, R, generator=g)


def _reference(x, a, b, token_slots):
    y = torch.zeros(x.shape[0], OUT)
    for t, s in enumerate(token_slots):
        if s >= 0:
            y[t] = b[s] @ (a[s] @ x[t])
    return y


def test_mixed_decode_and_prefill_routes_every_token_to_its_slot():
    a, b = _weights()
    token_slots = [2, -1, 0, 2, 1, 1, 1, -1, -1, 0, 0]  # 4 decode tokens, then prefill segments
    x = torch.randn(len(token_slots), IN)
    batch = LoRABatch.build(token_slots, num_decode_tokens=4, device=torch.device("cpu"))
    y = torch.zeros(len(token_slots), OUT)
    lora_add(y, x, a, b, batch)
    torch.testing.assert_close(y, _reference(x, a, b, token_slots), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[[1, 7, 8]], torch.zeros(3, OUT))  # base tokens untouched, bit for bit


def test_single_adapter_fast_path_and_all_base():
    a, b = _weights()
    x = torch.randn(5, IN)
    batch = LoRABatch.build([1] * 5, num_decode_tokens=2, device=torch.device("cpu"))
    assert batch.single_slot == 1
    y = torch.zeros(5, OUT)
    lora_add(y, x, a, b, batch)
    torch.testing.assert_close(y, _reference(x, a, b, [1] * 5), atol=1e-5, rtol=1e-5)
    assert LoRABatch.build([-1] * 5, num_decode_tokens=2, device=torch.device("cpu")) is None


def test_lane_view_is_updated_in_place():
    a, b = _weights()
    x = torch.randn(3, IN)
    y = torch.zeros(3, OUT + 6)
    batch = LoRABatch.build([0, -1, 2], num_decode_tokens=3, device=torch.device("cpu"))
    lora_add(y[:, 6:], x, a, b, batch)
    torch.testing.assert_close(y[:, 6:], _reference(x, a, b, [0, -1, 2]), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:, :6], torch.zeros(3, 6))
