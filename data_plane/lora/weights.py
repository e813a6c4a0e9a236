"""What a validated PEFT adapter looks like once read from disk (host memory, float32 or model dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_plane.lora.shared_layout import SharedLayout, TensorKey
from shared.engine_admin import AdapterDescription
from shared.peft import TARGET_MODULES

__all__ = ["TARGET_MODULES", "LoRAAdapterWeights", "LoRAModuleWeights"]


@dataclass
class LoRAModuleWeights:
    lora_a: torch.Tensor  # [r, in_features], as PEFT stores it
    lora_b: torch.Tensor  # [out_features, r]
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA; folded into B when copied into a slot

    def __post_init__(self) -> None:
        # The slots' input-major layout, so that copying into a slot is a plain copy per tensor. The loader
        # passes transposed views of it already (written into the adapter's shared file): nothing is copied
        # then. Otherwise it is made here, and lora_a / lora_b become views of it, so the host copy is not
        # held twice.
        self.a_t = self.lora_a.T.contiguous()  # [in, r]
        self.b_t = self.lora_b.T.contiguous()  # [r, out]
        self.lora_a, self.lora_b = self.a_t.T, self.b_t.T

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def __reduce__(self) -> tuple[object, ...]:
        # a_t / b_t may be views of one file holding the whole adapter; pickling a view (the tensor-parallel
        # broadcast of a slot write) writes its entire storage, once per tensor: a copy pickles only its bytes
        return _module_weights, (_own(self.a_t), _own(self.b_t), self.scaling)


def _module_weights(a_t: torch.Tensor, b_t: torch.Tensor, scaling: float) -> LoRAModuleWeights:
    return LoRAModuleWeights(lora_a=a_t.T, lora_b=b_t.T, scaling=scaling)


def _own(t: torch.Tensor) -> torch.Tensor:
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


@dataclass
class LoRAAdapterWeights:
    """A PEFT adapter validated against the base model: per layer, per projection, A and B."""

    path: str  # the folder it was read from
    description: AdapterDescription  # sha256 over adapter_config.json and the weights file: its identity
    layers: dict[int, dict[str, LoRAModuleWeights]] = field(default_factory=dict)  # layer -> module -> weights
    # The shared-memory file holding the tensors, keyed (layer, module, "a_t" | "b_t"; shared_layout.py):
    # handing the adapter to the engine-core process sends only this. The PEFT loader's weights are views
    # of it; weights built any other way have None until their first hand-over copies them into one. It
    # owns the file: dropping these weights removes it.
    shared: SharedLayout[TensorKey] | None = field(default=None, repr=False, compare=False)

    @property
    def cache_namespace(self) -> int:
        """Seed of the first KV block hash: derived from the content, never 0 (0 is the base model)."""
        return int(self.description.sha256[:16], 16) or 1

    def __getstate__(self) -> dict[str, object]:
        # a copy in another process (tensor-parallel broadcast) is not backed by the file and must not own it
        return {**self.__dict__, "shared": None}
