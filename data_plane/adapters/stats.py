"""Per-adapter request statistics for GET /v1/lora_stats, kept in memory with bounded windows.

Prometheus has the long-term series; this answers "how is adapter X doing right now" without a
Prometheus server: counts since the adapter was loaded, latency percentiles over the most recent
`window` requests, and output tokens/s over the last minute (per-second buckets).

`LoRAStatsSource` is the engine's side: its stats as far as the registry and the metrics read them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from data_plane.lora.slots import LoRAEngineStats

DEFAULT_WINDOW = 1000  # latency samples kept per adapter
RATE_WINDOW_S = 60


class LoRAStatsSource(Protocol):
    """data_plane.engine.llm_engine.EngineStats is one; `lora` is there with LoRA off too (no slots)."""

    @property
    def lora(self) -> LoRAEngineStats: ...


@dataclass
class _AdapterSeries:
    window: int
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("ok", "error", "abort", "rejected"), 0))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft: deque[float] = field(default_factory=deque)
    e2e: deque[float] = field(default_factory=deque)
    token_buckets: deque[list[int]] = field(default_factory=deque)  # [second, tokens], oldest first

    def __post_init__(self) -> None:
        self.ttft = deque(maxlen=self.window)
        self.e2e = deque(maxlen=self.window)

    def add_tokens(self, n: int, now: float) -> None:
        second = int(now)
        if self.token_buckets and self.token_buckets[-1][0] == second:
            self.token_buckets[-1][1] += n
        else:
            self.token_buckets.append([second, n])
        self._prune(now)

    def tokens_per_second(self, now: float) -> float:
        self._prune(now)
        return sum(n for _, n in self.token_buckets) / RATE_WINDOW_S

    def _prune(self, now: float) -> None:
        horizon = int(now) - RATE_WINDOW_S
        while self.token_buckets and self.token_buckets[0][0] <= horizon:
            self.token_buckets.popleft()


class AdapterRequestStats:
    """Fed by the per-request metrics (name = the resolved model name, base included)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._series: dict[str, _AdapterSeries] = {}

    def _get(self, name: str) -> _AdapterSeries:
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = _AdapterSeries(self.window)
        return series

    def record_tokens(self, name: str, n: int, now: float | None = None) -> None:
        self._get(name).add_tokens(n, time.monotonic() if now is None else now)

    def record_finish(
        self,
        name: str,
        outcome: str,
        prompt_tokens: int,
        generated_tokens: int,
        ttft: float | None,
        e2e: float | None,
    ) -> None:
        series = self._get(name)
        series.requests[outcome] = series.requests.get(outcome, 0) + 1
        series.prompt_tokens += prompt_tokens
        series.generated_tokens += generated_tokens
        if ttft is not None:
            series.ttft.append(ttft)
        if e2e is not None and outcome != "rejected":
            series.e2e.append(e2e)

    def forget(self, name: str) -> None:
        """The adapter was unloaded: its figures go with it (names must not accumulate forever)."""
        self._series.pop(name, None)

    def snapshot(self, name: str, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        s = self._series.get(name) or _AdapterSeries(self.window)
        return {
            "requests": dict(s.requests),
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_seconds": {"p50": percentile(s.ttft, 50), "p99": percentile(s.ttft, 99), "samples": len(s.ttft)},
            "e2e_seconds": {"p50": percentile(s.e2e, 50), "p99": percentile(s.e2e, 99), "samples": len(s.e2e)},
            "generated_tokens_per_second_1m": round(s.tokens_per_second(now), 3),
        }


def percentile(samples: deque[float] | list[float], q: float) -> float | None:
    """Nearest-rank percentile (a value that was actually observed); None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
