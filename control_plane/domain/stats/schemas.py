"""Wire schemas of GET /v1/lora_stats (msgspec)."""

from __future__ import annotations

import msgspec


class Latency(msgspec.Struct, kw_only=True):
    p50: float | None
    p99: float | None
    samples: int


class EngineAdapterStats(msgspec.Struct, kw_only=True):
    """One engine's figures for one adapter."""

    engine: str
    residency: str | None  # device | host | disk; None when the engine does not hold it now
    requests: dict[str, int]
    generated_tokens: int
    ttft_seconds: Latency
    e2e_seconds: Latency
    age_s: float  # how old these figures are (an engine that stopped answering keeps its last ones)


class AdapterStats(msgspec.Struct, kw_only=True):
    """One adapter across the fleet: counters summed, percentiles from the summed histograms."""

    name: str
    requests: dict[str, int]
    prompt_tokens: int
    generated_tokens: int
    generated_tokens_per_second_1m: float
    loads: int
    evictions: int
    ttft_seconds: Latency
    e2e_seconds: Latency
    engines: list[EngineAdapterStats]


class EngineFigures(msgspec.Struct, kw_only=True):
    engine: str
    age_s: float | None  # None: never answered
    error: str | None  # the last fetch's failure, if it failed


class LoraStats(msgspec.Struct, kw_only=True):
    adapters: list[AdapterStats]
    engines: list[EngineFigures]
