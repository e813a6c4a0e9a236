"""Runs greedy jobs through an LLMEngine (tensor-parallel or not) and prints their tokens as JSON.

A separate process per engine: torch.distributed allows one process group per process, and rank 0
of a tensor-parallel engine spawns its workers. Used by test_tensor_parallel.py.

    python -m tests.data_plane.engine.tp_driver SPEC_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.config import EngineConfig
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.model.config import ModelConfig


def main(spec: dict) -> dict:
    config = EngineConfig(model=spec["model"], device="cpu", block_size=4, **spec.get("engine", {}))
    engine = LLMEngine.from_config(config)
    model_config = ModelConfig.from_pretrained(spec["model"])
    weights = {
        adapter_id: load_peft_adapter(path, model_config, max_rank=64, allowed_roots=[str(Path(path).parent)])
        for adapter_id, path in enumerate(spec.get("adapters", []), start=1)
    }
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    biases = spec.get("logit_bias", {})  # job name -> {token id (a string): bias}
    tokens: dict[str, list[int]] = {}
    try:
        for number, phase in enumerate(spec["phases"]):  # each phase: jobs admitted together, run to completion
            if number == len(spec["phases"]) - 1:
                for adapter_id in spec.get("unload_before_last_phase", []):
                    engine.remove_lora(adapter_id)  # what an unload does once its requests have drained
            for name, prompt, adapter_id in phase:
                w = weights.get(adapter_id)
                bias = {int(t): v for t, v in biases[name].items()} if name in biases else None
                job_params = dataclasses.replace(params, logit_bias=bias)
                engine.add_request(Request(name, prompt, job_params, adapter_id=adapter_id,
                                           prefix_hash_seed=w.cache_namespace if w else 0, lora=w))
                tokens[name] = []
            while engine.has_work():
                for output in engine.step():
                    for delta in output.deltas:
                        tokens[output.request_id].extend(delta.token_ids)
        return {"tokens": tokens, "lora": _lora_summary(engine)}
    finally:
        engine.shutdown()


def _lora_summary(engine: LLMEngine) -> dict | None:
    stats = engine.stats().lora
    if stats is None:
        return None
    return {"slots_used": stats.slots_used, "loads": sum(a.loads for a in stats.adapters.values())}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
