"""EngineMetrics: own registry, per-request figures, engine stats read at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY

from data_plane.adapters.stats import AdapterRequestStats
from data_plane.lora.slots import AdapterEngineStats, LoRAEngineStats
from data_plane.metrics import EngineMetrics
from tests.data_plane.api.engines import engine_stats


def test_each_app_has_its_own_registry():
    a, b = EngineMetrics(base_name="base"), EngineMetrics(base_name="base")
    a.start_request(adapter="base").finish("ok")
    ok = {"adapter": "base", "outcome": "ok"}
    assert a.registry.get_sample_value("loraplane_requests_total", ok) == 1
    assert b.registry.get_sample_value("loraplane_requests_total", ok) == 0  # zeros exported for the base
    assert REGISTRY.get_sample_value("loraplane_requests_total", ok) is None


def test_request_timings():
    m = EngineMetrics(base_name="base")
    r = m.start_request(arrival=10.0, adapter="base")
    r.on_output(0, now=10.5)  # no tokens: not a token event
    r.on_output(2, now=11.0)
    r.on_output(1, now=11.25)
    r.finish("ok")
    r.finish("abort")  # counted once
    get = m.registry.get_sample_value
    assert get("loraplane_time_to_first_token_seconds_sum", {"adapter": "base"}) == 1.0
    assert get("loraplane_inter_token_latency_seconds_sum") == 0.25
    assert get("loraplane_generation_tokens_total", {"adapter": "base"}) == 3
    assert get("loraplane_requests_total", {"adapter": "base", "outcome": "ok"}) == 1
    assert get("loraplane_requests_total", {"adapter": "base", "outcome": "abort"}) == 0


def test_engine_stats_are_read_at_scrape_time():
    stats = engine_stats(num_running=2, num_waiting=1, kv_blocks_total=100, kv_blocks_used=7)
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


def test_adapter_label_cap_and_unresolved_names():
    m = EngineMetrics(base_name="base", max_adapter_labels=2)
    for name in ("a", "b", "c", "d", "a", None, "base"):
        m.start_request(adapter=name).finish("ok")
    get = m.registry.get_sample_value
    assert get("loraplane_requests_total", {"adapter": "a", "outcome": "ok"}) == 2
    assert get("loraplane_requests_total", {"adapter": "b", "outcome": "ok"}) == 1
    assert get("loraplane_requests_total", {"adapter": "other", "outcome": "ok"}) == 2  # c and d
    assert get("loraplane_requests_total", {"adapter": "", "outcome": "ok"}) == 1
    assert get("loraplane_requests_total", {"adapter": "base", "outcome": "ok"}) == 1
    assert get("loraplane_requests_total", {"adapter": "c", "outcome": "ok"}) is None


def test_engine_lora_counters_become_monotonic_prometheus_series():
    stats = engine_stats(lora=LoRAEngineStats(4, 1, {7: AdapterEngineStats(slot=0, running=2, waiting=1)}))
    names = {7: "poet", 8: "poet", 9: "short"}
    m = EngineMetrics(lambda: stats, base_name="base", adapter_names=names.get)
    a = stats.lora.adapters[7]
    a.loads, a.evictions, a.load_seconds_total, a.last_load_seconds = 1, 0, 0.02, 0.02
    text = m.render().decode()
    assert 'loraplane_lora_running_sequences{adapter="poet"} 2.0' in text
    assert 'loraplane_lora_waiting_sequences{adapter="poet"} 1.0' in text
    assert "loraplane_lora_slots_used 1.0" in text and "loraplane_lora_slots_total 4.0" in text
    assert 'loraplane_lora_device_resident{adapter="poet"} 1.0' in text
    assert 'loraplane_lora_loads_total{adapter="poet"} 1.0' in text
    assert 'loraplane_lora_load_seconds_bucket{adapter="poet",le="0.025"} 1.0' in text
    a.loads, a.evictions, a.load_seconds_total = 3, 1, 0.52  # two loads of 0.25 s between scrapes
    text = m.render().decode()
    assert 'loraplane_lora_loads_total{adapter="poet"} 3.0' in text
    assert 'loraplane_lora_evictions_total{adapter="poet"} 1.0' in text
    assert 'loraplane_lora_load_seconds_bucket{adapter="poet",le="0.25"} 3.0' in text
    # the old version is removed (its engine counters vanish), the new one starts from zero
    stats.lora.adapters = {8: AdapterEngineStats(slot=1, loads=1, load_seconds_total=0.01, last_load_seconds=0.01)}
    stats.lora.adapters[9] = AdapterEngineStats(loads=2, evictions=2, load_seconds_total=0.02)
    text = m.render().decode()
    assert 'loraplane_lora_loads_total{adapter="poet"} 4.0' in text  # never goes down
    assert 'loraplane_lora_loads_total{adapter="short"} 2.0' in text
    assert 'loraplane_lora_running_sequences{adapter="poet"} 0.0' in text
    assert 'loraplane_lora_device_resident{adapter="short"} 0.0' in text  # no slot: in host memory


def test_request_stats_are_fed_per_resolved_name():
    stats = AdapterRequestStats()
    m = EngineMetrics(base_name="base", request_stats=stats)
    r = m.start_request(arrival=0.0, adapter="poet")
    r.admitted(5)
    r.on_output(1, now=0.5)
    r.on_output(2, now=0.75)
    r.finish("ok")
    m.start_request(adapter=None).finish("rejected")  # unresolved: not recorded under any name
    poet = stats.snapshot("poet")
    assert poet["requests"]["ok"] == 1 and poet["prompt_tokens"] == 5 and poet["generated_tokens"] == 3
    assert poet["ttft_seconds"]["p50"] == 0.5 and poet["e2e_seconds"]["samples"] == 1
