"""The prefill pacer sizes long prompts' share of a step from the step times it is told: a step of
decodes and chunks stays within the stall limit of a decode-only step, the share grows at most twofold
a step, and one stalled step moves nothing."""

from __future__ import annotations

import pytest

from data_plane.engine.prefill_pacer import MIN_LONG_CHUNK, PROBE_EVERY, PrefillPacer

DECODES = 32
DECODE_STEP_S = 0.010


def pacer_with_decode_steps(stall_limit: float = 1.25, steps: int = 20) -> PrefillPacer:
    pacer = PrefillPacer(stall_limit)
    for _ in range(steps):
        pacer.observe(DECODES, 0, DECODE_STEP_S)
    return pacer


def run_chunks(pacer: PrefillPacer, seconds_per_token: float, steps: int, decode_step_s=lambda step: DECODE_STEP_S,
               num_long: int = 1) -> list[int]:
    """The shares of `steps` steps whose prefill tokens cost `seconds_per_token` each beside decodes that
    cost `decode_step_s(step)`, with `num_long` long prompts waiting; probe steps (share 0) left out."""
    shares = []
    for step in range(steps):
        share = pacer.long_prefill_budget(DECODES, num_long)
        if share:
            shares.append(share)
        pacer.observe(DECODES, share, decode_step_s(step) + share * seconds_per_token)
    return shares


def test_the_share_keeps_a_step_within_the_stall_limit_of_a_decode_step():
    pacer = pacer_with_decode_steps(stall_limit=1.25)
    shares = run_chunks(pacer, seconds_per_token=0.0001, steps=8)
    # 0.25 * 10 ms of room at 0.1 ms a token: 25 tokens, reached by doubling from the smallest share
    assert shares[-1] in (24, 25)  # (floats: 0.0025 / 0.0001 may come out a hair under 25)
    assert all(b <= 2 * a for a, b in zip(shares, shares[1:], strict=False))
    assert DECODE_STEP_S + shares[-1] * 0.0001 <= 1.25 * DECODE_STEP_S + 1e-12


def test_before_any_mixed_step_a_prefill_token_is_priced_as_a_decode_token():
    pacer = pacer_with_decode_steps()
    # 10 ms / 32 decodes per token: 8 tokens fit 2.5 ms, and 8 is twice the smallest share
    assert pacer.long_prefill_budget(DECODES) == int(0.25 * DECODES)


def test_costly_prefill_tokens_get_the_smallest_share_and_a_cheap_machine_a_large_one():
    costly = run_chunks(pacer_with_decode_steps(), seconds_per_token=0.001, steps=10)
    assert costly[-1] == MIN_LONG_CHUNK  # 2.5 ms of room holds 2 tokens; the prompt still progresses
    cheap = run_chunks(pacer_with_decode_steps(stall_limit=2.0), seconds_per_token=0.000001, steps=16)
    assert cheap[-1] >= 2048  # a GPU-like step: the token budget, not the pacer, bounds the chunk


def test_every_few_steps_the_decodes_run_alone_and_their_growing_cost_is_not_the_prompts():
    pacer = pacer_with_decode_steps()
    seen = []
    for _ in range(3 * PROBE_EVERY):
        share = pacer.long_prefill_budget(DECODES)
        seen.append(share)
        pacer.observe(DECODES, share, DECODE_STEP_S + share * 0.0001)
    assert [i for i, share in enumerate(seen) if share == 0] == [PROBE_EVERY, 2 * PROBE_EVERY + 1]
    # decodes twice as dear after a while (their contexts grew) and prefill tokens as cheap as before:
    # the probes see it, and the share grows with the room instead of shrinking to the smallest
    pacer = pacer_with_decode_steps()
    shares = run_chunks(pacer, 0.0001, 8 * PROBE_EVERY, decode_step_s=lambda step: DECODE_STEP_S * (1 + (step > 4)))
    assert shares[-1] >= 40  # 0.25 * 20 ms / 0.1 ms = 50, less what the drift's first steps left in c


def test_one_stalled_step_moves_neither_estimate():
    pacer = pacer_with_decode_steps()
    before = run_chunks(pacer, seconds_per_token=0.0001, steps=8)[-1]
    pacer.observe(DECODES, 0, 1.0)  # the machine stalled a decode-only step
    pacer.observe(DECODES, before, 2.0)  # and a mixed one
    assert pacer.long_prefill_budget(DECODES) == before


def test_without_decode_steps_the_smallest_share_and_no_pacing_of_idle_steps():
    pacer = PrefillPacer(1.25)
    pacer.observe(0, 2048, 1.0)  # no decodes beside it: nothing to learn
    assert pacer.long_prefill_budget(DECODES) == MIN_LONG_CHUNK


def test_a_stall_limit_of_one_or_less_is_refused():
    with pytest.raises(ValueError, match="above 1"):
        PrefillPacer(1.0)


def test_many_long_prompts_per_decode_raise_the_limit():
    # 8 long prompts beside 32 decodes: 1 + 8/32 = 1.25, the stall limit; 16: 1.5, twice the room; 32: 2
    assert run_chunks(pacer_with_decode_steps(), 0.0001, steps=8, num_long=8)[-1] in (24, 25)
    assert run_chunks(pacer_with_decode_steps(), 0.0001, steps=8, num_long=16)[-1] in (49, 50)
    assert run_chunks(pacer_with_decode_steps(), 0.0001, steps=8, num_long=32)[-1] in (99, 100)
