"""Turns the scheduler's decision into one StepInput: flat tokens, positions, KV slots, adapters."""

from __future__ import annotations

import torch

from data_plane.engine.scheduler import SchedulerOutput
from data_plane.engine.sequence import Sequence
from data_plane.lora.slots import LoRASlotManager
from data_plane.model.attention_metadata import DecodeEntry, PrefillEntry, build_attention_metadata
from data_plane.model.lora_batch import LoRABatch
from data_plane.model.sampler import SamplingRow
from data_plane.model.step_input import StepInput


class BatchBuilder:
    def __init__(
        self, block_size: int, device: torch.device, lora_slots: LoRASlotManager | None = None,
        fold_chunks: bool = False,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.lora_slots = lora_slots
        self.fold_chunks = fold_chunks  # see build_attention_metadata

    def build(self, sched: SchedulerOutput) -> tuple[StepInput, list[Sequence]]:
        """The step input and the sequences in the order of its logits rows: every decode and each
        prefill whose chunk reaches its last token (a prefill chunk short of it samples nothing)."""
        token_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        seqs: list[Sequence] = []

        decode_entries: list[DecodeEntry] = []
        for seq in sched.decodes:
            position = len(seq) - 1  # the last sampled token, not yet in the cache
            token_ids.append(seq.last_token_id)
            positions.append(position)
            logits_indices.append(len(token_ids) - 1)
            decode_entries.append(DecodeEntry(seq.block_table, position + 1))
            seqs.append(seq)

        prefill_entries: list[PrefillEntry] = []
        for item in sched.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            if item.completes_prompt:
                logits_indices.append(len(token_ids) - 1)
                seqs.append(seq)
            # only the blocks up to the chunk's end: attention gathers no blocks it cannot see yet
            table = seq.block_table[: -(-end // self.block_size)]
            prefill_entries.append(PrefillEntry(table, start, item.num_new_tokens))

        attn = build_attention_metadata(decode_entries, prefill_entries, self.block_size, self.device, self.fold_chunks)
        adapter_ids = [s.adapter_id for s in sched.decodes] + [p.seq.adapter_id for p in sched.prefills]
        lora = None
        if self.lora_slots is not None and any(adapter_ids):  # base-only steps skip LoRA entirely
            token_slots: list[int] = []
            for seq in sched.decodes:
                token_slots.append(_token_slot(self.lora_slots, seq))
            for item in sched.prefills:
                token_slots.extend([_token_slot(self.lora_slots, item.seq)] * item.num_new_tokens)
            rank = max((self.lora_slots.slot_rank[s] for s in set(token_slots) if s >= 0), default=0)
            lora = LoRABatch.build(token_slots, len(sched.decodes), rank, self.device)
        return StepInput(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn=attn,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            adapter_ids=adapter_ids,
            lora=lora,
        ), seqs


def _token_slot(lora_slots: LoRASlotManager, seq: Sequence) -> int:
    """The LoRA slot of the sequence's tokens (-1: the base model)."""
    return -1 if seq.adapter_id == 0 else lora_slots.slot(seq.adapter_id)


def sampling_rows(seqs: list[Sequence]) -> list[SamplingRow]:
    """What the sampler needs of each sequence, in the order of the logits rows (lists are shared, not copied)."""
    rows = []
    for seq in seqs:
        p = seq.sampling_params
        rows.append(SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty, logprobs=p.logprobs, logit_bias=p.logit_bias,
            below_min_tokens=len(seq.output_token_ids) < p.min_tokens, stop_token_ids=p.stop_token_ids,
            prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids, generator=seq.generator,
        ))
    return rows
