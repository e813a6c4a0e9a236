"""How this engine reads an adapter folder: its base model, rank limit and roots, picklable so that the
adapter reader process (reader_process.py) reads exactly as the API process would."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.config import EngineConfig
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from shared.peft import resolve_under_roots


@dataclass(frozen=True)
class AdapterReading:
    """PEFT files validated against the base model, rank and roots. Folders under `cache_dir` (the artifact
    cache: the engine's own folder of verified versions) need no root."""

    model_config: ModelConfig
    max_rank: int
    lora_roots: tuple[str, ...]
    cache_dir: str | None = None

    @classmethod
    def of(cls, config: EngineConfig, cache_dir: str | None = None) -> AdapterReading:
        return cls(ModelConfig.from_pretrained(config.model), config.max_lora_rank, tuple(config.lora_roots), cache_dir)

    def read(self, path: str, verified: VerifiedFiles | None = None,
             pace: Callable[[], None] | None = None) -> LoRAAdapterWeights:
        """`verified`: files this engine hashed itself (unchanged ones are not hashed again) and the bytes
        of a version it just fetched (read from memory). `pace`: called between pieces of the work
        (background.CpuPace)."""
        cached = self.cache_dir is not None and resolve_under_roots(path, [self.cache_dir]) is not None
        roots = [self.cache_dir] if cached and self.cache_dir is not None else list(self.lora_roots)
        # host copies stay float32 (the loader's default): the engine folds the scale in and casts once
        # when it copies into a slot, so the model dtype's rounding happens only there
        return load_peft_adapter(path, model_config=self.model_config, max_rank=self.max_rank,
                                 allowed_roots=roots, verified=verified, pace=pace)


def loader_for(config: EngineConfig, cache_dir: str | None = None, verified: VerifiedFiles | None = None,
               ) -> Callable[[str], LoRAAdapterWeights]:
    """The engine's adapter loader in this process: path -> validated weights (AdapterReading.read)."""
    return functools.partial(AdapterReading.of(config, cache_dir).read, verified=verified)
