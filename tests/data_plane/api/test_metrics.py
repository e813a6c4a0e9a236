"""EngineMetrics: own registry, per-request figures, engine stats read at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY

from data_plane.metrics import EngineMetrics
from tests.data_plane.api.fakes import FakeStats


def test_each_app_has_its_own_registry():
    a, b = EngineMetrics(), EngineMetrics()
    a.start_request().finish("ok")
    assert a.registry.get_sample_value("loraplane_requests_total", {"outcome": "ok"}) == 1
    assert b.registry.get_sample_value("loraplane_requests_total", {"outcome": "ok"}) == 0
    assert REGISTRY.get_sample_value("loraplane_requests_total", {"outcome": "ok"}) is None


def test_request_timings():
    m = EngineMetrics()
    r = m.start_request(arrival=10.0)
    r.on_output(0, now=10.5)  # no tokens: not a token event
    r.on_output(2, now=11.0)
    r.on_output(1, now=11.25)
    r.finish("ok")
    r.finish("abort")  # counted once
    get = m.registry.get_sample_value
    assert get("loraplane_time_to_first_token_seconds_sum") == 1.0
    assert get("loraplane_inter_token_latency_seconds_sum") == 0.25
    assert get("loraplane_generation_tokens_total") == 3
    assert get("loraplane_requests_total", {"outcome": "ok"}) == 1
    assert get("loraplane_requests_total", {"outcome": "abort"}) == 0


def test_engine_stats_are_read_at_scrape_time():
    stats = FakeStats(num_running=2, num_waiting=1, kv_blocks_total=100, kv_blocks_used=7)
    m = EngineMetrics(lambda: stats)
    text = m.render().decode()
    assert "loraplane_running_sequences 2.0" in text and "loraplane_kv_blocks_used 7.0" in text
    stats.kv_blocks_used = 0
    stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens = 64, 32
    text = m.render().decode()
    assert "loraplane_kv_blocks_used 0.0" in text
    assert "loraplane_prefix_cache_queried_tokens_total 64.0" in text
    assert "loraplane_prefix_cache_hit_tokens_total 32.0" in text


def test_failing_stats_do_not_break_the_scrape():
    def broken():
        raise RuntimeError("engine gone")

    text = EngineMetrics(broken).render().decode()
    assert "loraplane_requests_total" in text and "loraplane_kv_blocks_used" not in text
