"""Real engines for the HTTP-layer tests, and the faults they can be given.

`make_engine(model_dir, **config)` builds an AsyncLLMEngine on the tiny demo checkpoint (about half
a second; not started: the app starts it inside its own loop). Faults are injected into that real
engine, so what a test sees is the engine's own path for them: a batch that fails in the forward
pass, a refusal on admission, a step loop that dies, a stalled step loop (its queue then fills).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from data_plane.config import EngineConfig
from data_plane.engine.async_engine import AsyncLLMEngine
from data_plane.engine.llm_engine import EngineStats
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sampling_params import SamplingParams
from data_plane.lora.slots import LoRAEngineStats
from shared.errors import EngineDeadError

SERVED = "demo"
MAX_MODEL_LEN = 64
MAX_BODY = 4096
STALL_LIMIT_S = 20  # a stalled loop resumes on its own after this long, so a failing test cannot hang


def engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = {
        "model": str(model_dir),
        "device": "cpu",
        "served_model_name": SERVED,
        "max_model_len": MAX_MODEL_LEN,
        "num_kv_blocks": 64,
        "block_size": 4,
        "max_request_body_bytes": MAX_BODY,
        "num_threads": 1,  # the CI machine has two cores for everything
        **overrides,
    }
    return EngineConfig(**fields)


def make_engine(model_dir: Path, **overrides: object) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_config(engine_config(model_dir, **overrides))


def greedy(max_tokens: int = 5, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def fail_batches_after(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """From the forward pass number `steps` on (0: the first), every batch fails in the model: the
    engine fails that batch's requests (`output.error`) and serves on."""
    runner = engine.engine.runner
    real = runner.forward
    calls = iter(range(10**9))

    def forward(step_input: object) -> object:
        if next(calls) >= steps:
            raise RuntimeError("boom: injected forward failure")
        return real(step_input)

    monkeypatch.setattr(runner, "forward", forward)


def refuse_admission(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    """The engine's own admission check raises `exc` (an unexpected one tests the 500 path)."""

    def validate(request: object) -> None:
        raise exc

    monkeypatch.setattr(engine.engine, "validate", validate)


def kill_loop_on_next_step(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    """The next step raises EngineDeadError(reason), as when a tensor-parallel rank is gone: the
    loop stops, every request in flight fails, /health turns 503 with the reason."""

    def step() -> list[RequestOutput]:
        raise EngineDeadError(reason)

    monkeypatch.setattr(engine.engine, "step", step)


@contextmanager
def stalled(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch, step_s: float = STALL_LIMIT_S) -> Iterator[None]:
    """While inside, every step first blocks for `step_s` (a long forward pass): requests posted
    meanwhile stay queued and count against --max-waiting-requests."""
    resume = threading.Event()
    real: Callable[[], list[RequestOutput]] = engine.engine.step

    def step() -> list[RequestOutput]:
        resume.wait(step_s)
        return real()

    monkeypatch.setattr(engine.engine, "step", step)
    try:
        yield
    finally:
        monkeypatch.setattr(engine.engine, "step", real)
        resume.set()


def engine_stats(lora: LoRAEngineStats | None = None, **figures: int) -> EngineStats:
    """The engine's stats struct with these figures (the rest zero; LoRA off unless given), for the
    tests of what reads it (metrics, the registry)."""
    fields = dict.fromkeys(("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used",
                            "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_preemptions"), 0)
    no_lora = LoRAEngineStats(slots_total=0, slots_used=0, adapters={})
    return EngineStats(**{**fields, **figures}, lora=lora or no_lora)


def sample_sum(registry, name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels include `labels` (0 when there are none): the tests ask
    "how many ok requests" without caring which `adapter` label they carry."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
