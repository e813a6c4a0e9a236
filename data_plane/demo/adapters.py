"""Random but seeded PEFT-format LoRA adapters for the demo base model (data_plane/demo/model_builder.py).

They carry no knowledge; they exist so that a newcomer sees each adapter change the answers on the first
run. Files are laid out exactly as peft's save_pretrained writes them (adapter_config.json +
adapter_model.safetensors with `base_model.model.…lora_A.weight` keys), written without importing peft.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from data_plane.adapters.loading.peft_targets import module_name
from data_plane.lora.weights import TARGET_MODULES

# Standard deviation of each module's delta scale * B @ A, chosen against the demo base's linear weights
# (std 0.1): large enough that greedy answers differ from the base from the first tokens on, small enough
# that the model still wanders over many tokens instead of looping on one.
DELTA_STD = 0.06


@dataclass(frozen=True)
class DemoAdapter:
    r: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


DEMO_ADAPTERS: dict[str, DemoAdapter] = {
    "demo-pirate": DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES),
    "demo-poet": DemoAdapter(r=16, lora_alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    "demo-short": DemoAdapter(r=4, lora_alpha=8, target_modules=("gate_proj", "up_proj", "down_proj"), use_rslora=True),
}


def write_demo_adapters(
    base_dir: Path, out_root: Path, seed: int = 0, *, names: Iterable[str] | None = None,
    base_model: str | None = None,
) -> dict[str, Path]:
    """Write DEMO_ADAPTERS (or only `names`) for the model in base_dir to out_root/<name>; name -> folder.
    Their `base_model_name_or_path` is `base_model` (e.g. the name an engine serves the model under),
    else base_dir.

    Deterministic: the same base config, seed and base model string give byte-identical files.
    """
    written: dict[str, Path] = {}
    for name in DEMO_ADAPTERS if names is None else names:
        # crc32, not hash(): Python salts str hashes per process
        written[name] = write_lora_adapter(
            base_dir, Path(out_root) / name, DEMO_ADAPTERS[name], seed * 1_000_003 + zlib.crc32(name.encode()),
            base_model=base_model,
        )
    return written


def write_lora_adapter(base_dir: Path, out: Path, spec: DemoAdapter, seed: int, *, base_model: str | None = None,
                       delta_std: float = DELTA_STD, dtype: torch.dtype = torch.float32) -> Path:
    """One random PEFT-format adapter of the given shape for the model in base_dir (benchmarks use it too);
    its config names `base_model`, else base_dir, as its base model. delta_std: the std of each module's
    scale * B @ A; dtype: the stored tensors'."""
    base_config = json.loads((Path(base_dir) / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "adapter_config.json", _peft_config(spec, base_model or str(base_dir)))
    tensors = {k: v.to(dtype) for k, v in _weights(spec, base_config, seed, delta_std).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _peft_config(spec: DemoAdapter, base_model: str) -> dict[str, Any]:
    """The fields every peft release since 0.10 writes and reads; later releases add more, all optional."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(spec.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": spec.use_rslora,
    }


def _weights(spec: DemoAdapter, base_config: dict[str, Any], seed: int, delta_std: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = base_config["hidden_size"], base_config["intermediate_size"]
    heads = base_config["num_attention_heads"]
    head_dim = base_config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, base_config.get("num_key_value_heads", heads) * head_dim
    features = {  # (in, out), as nn.Linear's weight [out, in]
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base_config["num_hidden_layers"]):
        for short in spec.target_modules:
            in_f, out_f = features[short]
            a_std = 1.0 / math.sqrt(in_f)
            # std of (scale * B @ A)[i, j] = scale * sqrt(r) * a_std * b_std: solve for delta_std
            b_std = delta_std / (spec.scaling * math.sqrt(spec.r) * a_std)
            key = f"base_model.model.{module_name(layer, short)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(spec.r, in_f, generator=gen) * a_std).contiguous()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, spec.r, generator=gen) * b_std).contiguous()
    return tensors


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    # peft writes sorted keys with indent 2
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
