"""Sampler tests; transformers' logits processors serve as an independent oracle."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from data_plane.model.sampler import Sampler, SamplingRow, _apply_penalties, apply_min_p, apply_top_k_top_p

EOS = 2


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    min_tokens: int = 0,
    **params: object,
) -> SamplingRow:
    """One sequence's row as the engine builds it: min_tokens is pending while the output is shorter."""
    output = list(output or [])
    return SamplingRow(
        prompt_token_ids=prompt or [0, 1],
        output_token_ids=output,
        below_min_tokens=len(output) < min_tokens,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        **params,  # type: ignore[arg-type]
    )


def test_greedy_fast_path_equals_argmax() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    rows = [make_row(temperature=0.0) for _ in range(8)]
    out = Sampler({EOS})(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_equal_argmax() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    rows = [make_row(temperature=0.0 if i % 2 == 0 else 1.0, top_k=5) for i in range(6)]
    before = logits.clone()
    out = Sampler({EOS})(logits, rows)
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_logit_bias_applies_to_its_rows_only_and_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 60, generator=gen) * 3
    biases: list[dict[int, float] | None] = [{7: 100.0}, None, {int(logits[2].argmax()): -100.0, 3: 2.5}, None, {}]
    rows = [make_row(temperature=0.0, logit_bias=b) for b in biases]
    before = logits.clone()
    out = Sampler({EOS})(logits, rows)
    expected = []
    for i, bias in enumerate(biases):
        processor = SequenceBiasLogitsProcessor({(t,): v for t, v in (bias or {}).items()}) if bias else None
        row = logits[i : i + 1].clone()
        expected.append(int((processor(torch.zeros(1, 1, dtype=torch.long), row) if processor else row).argmax()))
    assert out.token_ids == expected
    assert out.token_ids[0] == 7 and out.token_ids[2] != int(logits[2].argmax())
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_logprobs_are_reported_before_the_logit_bias() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(6))
    rows = [make_row(temperature=0.0, logprobs=1, logit_bias={9: 100.0}), make_row(temperature=0.0, logprobs=1)]
    out = Sampler({EOS})(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] == 9 and out.logprobs is not None
    assert out.logprobs[0][9] == pytest.approx(float(raw[0, 9]))
    assert out.logprobs[1][out.token_ids[1]] == pytest.approx(float(raw[1].max()))


def bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    """[ceil(V/32)] int32 with bit t % 32 of word t // 32 set for each allowed token (llguidance's layout)."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_a_token_bitmask_masks_its_rows_only_and_logprobs_stay_raw() -> None:
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(7)) * 3
    allowed = [5, 31, 63, 69]  # words 0, 1 and 2, a sign bit among them
    rows = [make_row(temperature=0.0, logprobs=1, allowed_tokens=bitmask(allowed, 70)), make_row(temperature=0.0),
            make_row(temperature=0.8, seed=1, allowed_tokens=bitmask([31], 70))]
    before = logits.clone()
    out = Sampler({EOS})(logits, rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
    assert out.token_ids[1] == int(logits[1].argmax()) and out.token_ids[2] == 31
    assert out.logprobs is not None  # before the mask, as vLLM reports them by default
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(float(torch.log_softmax(logits[0], -1)[out.token_ids[0]]))
    assert torch.equal(logits, before)


def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    logits = torch.randn(4, vocab, generator=gen) * 3
    penalties = [1.0, 1.3, 0.7, 2.0]
    prompts = [[1, 5, 7], [3, 3, 9, 11], [0, 20], [4]]
    outputs = [[2], [12, 3], [], [40, 41, 4]]
    rows = [
        make_row(prompt=prompts[i], output=outputs[i], temperature=0.0, repetition_penalty=penalties[i])
        for i in range(4)
    ]
    ours = _apply_penalties(logits, rows)
    for i in range(4):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        oracle = RepetitionPenaltyLogitsProcessor(penalties[i])(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], oracle)
        assert Sampler({EOS})(logits[i : i + 1], [rows[i]]).token_ids == [int(oracle.argmax())]


def test_presence_and_frequency_penalty_arithmetic() -> None:
    logits = torch.tensor([[0.0, -1.0, 1.0, 2.0, 0.5, 0.0]])
    row = make_row(
        prompt=[3],
        output=[1, 1, 2],
        frequency_penalty=0.5,
        presence_penalty=0.25,
        repetition_penalty=2.0,
    )
    # token 1: -1 * 2 (repetition) - 2 * 0.5 - 0.25 = -3.25; token 2: 1 / 2 - 0.5 - 0.25 = -0.25
    # token 3 is in the prompt only: repetition applies, frequency/presence do not -> 2 / 2 = 1
    expected = torch.tensor([[0.0, -3.25, -0.25, 1.0, 0.5, 0.0]])
    torch.testing.assert_close(_apply_penalties(logits, [row]), expected)


@pytest.mark.parametrize("top_k", [1, 3, 17, 64])
def test_top_k_matches_transformers(top_k: int) -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(top_k))
    ours = apply_top_k_top_p(logits, torch.full((5,), top_k), torch.ones(5))
    oracle = TopKLogitsWarper(top_k)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(oracle))


def test_top_p_and_min_p_match_transformers_per_row() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 200, generator=gen) * 2
    top_p = [0.05, 0.3, 0.5, 0.9, 0.99, 1.0]
    min_p = [0.0, 0.01, 0.1, 0.3, 0.7, 1.0]
    ours_p = apply_top_k_top_p(logits, torch.full((6,), 200), torch.tensor(top_p))
    ours_min = apply_min_p(logits, torch.tensor(min_p))
    for i in range(6):
        row = logits[i : i + 1]
        oracle_p = TopPLogitsWarper(top_p[i])(None, row.clone())
        assert torch.equal(torch.isfinite(ours_p[i : i + 1]), torch.isfinite(oracle_p)), top_p[i]
        if min_p[i] > 0:
            oracle_min = MinPLogitsWarper(min_p[i])(None, row.clone())
            assert torch.equal(torch.isfinite(ours_min[i : i + 1]), torch.isfinite(oracle_min)), min_p[i]
    assert torch.isfinite(ours_min[0]).all()  # min_p 0 keeps everything


def test_top_k_then_top_p_matches_transformers_chain() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4)) * 2
    ours = apply_top_k_top_p(logits, torch.tensor([20]), torch.tensor([0.6]))
    oracle = TopPLogitsWarper(0.6)(None, TopKLogitsWarper(20)(None, logits.clone()))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(oracle))


def test_sampled_tokens_stay_inside_the_filtered_set() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(5)).expand(2000, 100)
    kept = torch.isfinite(
        apply_min_p(
            apply_top_k_top_p(logits[:1], torch.tensor([30]), torch.tensor([0.8])), torch.tensor([0.05])
        )
    )[0]
    rows = [make_row(temperature=1.0, top_k=30, top_p=0.8, min_p=0.05, seed=i) for i in range(2000)]
    out = Sampler({EOS})(logits, rows)
    assert all(kept[t] for t in out.token_ids)
    assert len(set(out.token_ids)) > 1  # it really samples


def test_temperature_sampling_frequencies_match_softmax() -> None:
    n, temperature = 20_000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    rows = [make_row(temperature=temperature) for _ in range(n)]
    with torch.random.fork_rng():
        torch.manual_seed(6)
        out = Sampler({EOS})(base.expand(n, 5).contiguous(), rows)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    expected = torch.softmax(base.double() / temperature, dim=0) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (observed, expected)  # df = 4: p(chi2 > 25) ~ 5e-5


def test_seeded_rows_are_reproducible_and_independent_of_batch() -> None:
    vocab, steps = 300, 6
    gen = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    sampler = Sampler({EOS})

    def run(batch_size: int, position: int) -> list[int]:
        target = make_row(temperature=0.9, top_p=0.95, seed=1234)
        others = [make_row(temperature=1.0, seed=None if i % 2 else i) for i in range(batch_size - 1)]
        rows = others[:position] + [target] + others[position:]
        for logits in step_logits:
            batch = torch.randn(len(rows), vocab)
            batch[position] = logits
            out = sampler(batch, rows)
            for row, tok in zip(rows, out.token_ids, strict=True):
                row.output_token_ids.append(tok)
        return target.output_token_ids

    alone = run(1, 0)
    assert run(1, 0) == alone
    assert run(5, 2) == alone
    assert run(9, 8) == alone
    assert len(set(alone)) > 1


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(3, 10)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 4] = 8.0
    rows = [
        make_row(temperature=0.0, min_tokens=2, stop_token_ids=[7], output=[5]),
        make_row(temperature=0.0, min_tokens=2, stop_token_ids=[7], output=[5, 5]),
        make_row(temperature=1.0, min_tokens=2, stop_token_ids=[7], seed=0),
    ]
    out = Sampler({EOS})(logits, rows)
    assert out.token_ids[0] == 4  # eos and stop id masked while output is shorter than min_tokens
    assert out.token_ids[1] == EOS  # min_tokens reached: eos allowed again
    assert out.token_ids[2] not in (EOS, 7)


def test_logprobs_are_raw_log_softmax_with_top_ids() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(8))
    rows = [
        make_row(temperature=0.0, logprobs=5, repetition_penalty=1.5, prompt=[int(logits[0].argmax())]),
        make_row(temperature=1.0, logprobs=0, seed=3),
        make_row(temperature=0.0),
    ]
    out = Sampler({EOS})(logits, rows)
    assert out.logprobs is not None
    reference = torch.log_softmax(logits, dim=-1)
    for i, n in ((0, 5), (1, 0)):
        entry = out.logprobs[i]
        assert next(iter(entry)) == out.token_ids[i]  # sampled token first
        top_ids = reference[i].topk(n).indices.tolist() if n else []
        assert set(entry) == {out.token_ids[i], *top_ids}
        for tok, lp in entry.items():
            assert math.isclose(lp, float(reference[i, tok]), rel_tol=1e-5, abs_tol=1e-6)
    assert out.logprobs[2] == {}
