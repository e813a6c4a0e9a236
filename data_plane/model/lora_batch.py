"""LoRABatch: which device slot each token of a step uses, grouped for the batched ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """Per-step LoRA routing, built once by the BatchBuilder and passed to every LoRA layer.

    Tokens of the base model (adapter 0) appear nowhere here, so they get exactly the base output.
    """

    rank: int  # the largest rank among the step's adapters: the ops skip the zero padding past it
    single_slot: int | None  # every token of the step uses this slot: one plain matmul per layer
    decode_index: torch.Tensor | None  # [Nd] int64: decode tokens (flat indices) that use an adapter
    decode_slots: torch.Tensor | None  # [Nd] int64: their slots (gather + bmm)
    decode_contiguous: bool  # decode_index is exactly 0..Nd-1: the deltas add to a slice
    prefill_segments: list[tuple[int, int, int]]  # (slot, start, end): runs of prefill tokens of one adapter
    _segment_table: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _routed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def segment_table(self, device: torch.device) -> torch.Tensor:
        """prefill_segments as one [segments, 3] int64 tensor on `device` (SGMV kernels read it), made on
        the first layer's call and shared by every other layer of the step."""
        if self._segment_table is None:
            self._segment_table = torch.tensor(self.prefill_segments, dtype=torch.int64, device=device).view(-1, 3)
        return self._segment_table

    def routed(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every routed token as (index [N], slots [N]) int64 on `device`, tokens of one slot side by side:
        the decode tokens sorted by slot, then each prefill segment's tokens. The CPU kernels read a run of
        equal slots as one SGMV segment (each weight read once for up to 4 tokens). Made on the first
        layer's call and shared by every other layer of the step, like segment_table."""
        if self._routed is None:
            pairs: list[tuple[int, int]] = []
            if self.decode_index is not None and self.decode_slots is not None:
                pairs = sorted(zip(self.decode_slots.tolist(), self.decode_index.tolist(), strict=True))
            index = [i for _, i in pairs] + [i for _, start, end in self.prefill_segments for i in range(start, end)]
            slots = [s for s, _ in pairs] + [s for s, start, end in self.prefill_segments for _ in range(start, end)]
            self._routed = (torch.tensor(index, dtype=torch.int64, device=device),
                            torch.tensor(slots, dtype=torch.int64, device=device))
        return self._routed

    @classmethod
    def build(
        cls,
        token_slots: list[int],  # [T] slot per flat token, -1 for the base model
        num_decode_tokens: int,
        rank: int,
        device: torch.device,
    ) -> LoRABatch | None:
        used = set(token_slots)
        if used == {-1}:
            return None
        if len(used) == 1:
            return cls(rank, token_slots[0], None, None, decode_contiguous=False, prefill_segments=[])
        decode = [(i, s) for i, s in enumerate(token_slots[:num_decode_tokens]) if s >= 0]
        decode_index = decode_slots = None
        if decode:
            decode_index = torch.tensor([i for i, _ in decode], dtype=torch.int64, device=device)
            decode_slots = torch.tensor([s for _, s in decode], dtype=torch.int64, device=device)
        # a prefill sequence's tokens are contiguous, and neighbours with the same adapter merge
        segments: list[tuple[int, int, int]] = []
        for i in range(num_decode_tokens, len(token_slots)):
            slot = token_slots[i]
            if slot < 0:
                continue
            if segments and segments[-1][0] == slot and segments[-1][2] == i:
                segments[-1] = (slot, segments[-1][1], i + 1)
            else:
                segments.append((slot, i, i + 1))
        return cls(rank, None, decode_index, decode_slots, len(decode) == num_decode_tokens, segments)
