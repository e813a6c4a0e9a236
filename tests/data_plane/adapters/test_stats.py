"""AdapterRequestStats: the bounded per-adapter figures behind GET /v1/lora_stats."""

from __future__ import annotations

from data_plane.adapters.stats import AdapterRequestStats, percentile


def test_percentile_is_nearest_rank():
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0 and percentile(samples, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_latency_window_is_bounded_and_counts_are_not():
    stats = AdapterRequestStats(window=10)
    for i in range(25):
        stats.record_finish("a", "ok", prompt_tokens=2, generated_tokens=3, ttft=float(i), e2e=float(i) + 1)
    stats.record_finish("a", "rejected", 0, 0, None, 0.5)
    s = stats.snapshot("a")
    assert s["requests"] == {"ok": 25, "error": 0, "abort": 0, "rejected": 1}
    assert s["prompt_tokens"] == 50 and s["generated_tokens"] == 75
    assert s["ttft_seconds"]["samples"] == 10 and s["ttft_seconds"]["p50"] == 19.0  # the last 10: 15..24
    assert s["e2e_seconds"]["samples"] == 10  # a rejected request has no end-to-end latency


def test_tokens_per_second_over_the_last_minute():
    stats = AdapterRequestStats()
    stats.record_tokens("a", 60, now=1000.0)
    stats.record_tokens("a", 60, now=1030.2)
    assert stats.snapshot("a", now=1031.0)["generated_tokens_per_second_1m"] == 2.0
    assert stats.snapshot("a", now=1075.0)["generated_tokens_per_second_1m"] == 1.0  # first bucket aged out
    assert stats.snapshot("a", now=2000.0)["generated_tokens_per_second_1m"] == 0.0


def test_forget_and_unknown_names():
    stats = AdapterRequestStats()
    stats.record_finish("a", "ok", 1, 1, 0.1, 0.2)
    stats.forget("a")
    assert stats.snapshot("a")["requests"]["ok"] == 0 and stats.snapshot("never")["ttft_seconds"]["p50"] is None
