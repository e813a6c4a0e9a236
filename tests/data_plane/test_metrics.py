"""Engine-wide figures on /metrics of a real app on the demo model: preemptions and adapters per step."""

from __future__ import annotations

from litestar.testing import TestClient

from data_plane.api.app import create_app
from data_plane.config import EngineConfig
from data_plane.engine.async_engine import AsyncLLMEngine


def _samples(text: str, name: str) -> dict[str, float]:
    """Samples of one series family from an exposition: {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def test_preemptions_and_adapters_per_step_are_exported(demo_model_dir):
    # 16 blocks of 4 tokens; four samples of 8 + 24 tokens need 32 blocks: the cache runs full
    config = EngineConfig(model=str(demo_model_dir), device="cpu", served_model_name="demo", max_model_len=64,
                          num_kv_blocks=16, block_size=4, num_threads=1)
    engine = AsyncLLMEngine.from_config(config)
    with TestClient(create_app(engine, engine.config)) as client:
        assert _samples(client.get("/metrics").text, "loraplane_num_preemptions_total") == {
            "loraplane_num_preemptions_total": 0.0
        }
        body = {"model": "demo", "prompt": "one two three four five", "max_tokens": 24, "n": 4,
                "temperature": 0.0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert all(len(c["text"]) > 0 for c in response.json()["choices"])
        text = client.get("/metrics").text
    preemptions = _samples(text, "loraplane_num_preemptions_total")["loraplane_num_preemptions_total"]
    assert preemptions == engine.engine.scheduler.num_preemptions > 0
    steps = _samples(text, "loraplane_step_adapters")
    # base-only traffic: every step ran no adapter, so every step sits in the le="0" bucket
    assert steps['loraplane_step_adapters_bucket{le="0"}'] == steps["loraplane_step_adapters_count"] > 24
    assert steps["loraplane_step_adapters_sum"] == 0.0
