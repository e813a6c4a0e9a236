"""PEFT LoRA adapters written by the real `peft` library on a tiny base checkpoint (test-only).

peft initialises lora_B to zero (a fresh adapter is a no-op), so both A and B are re-drawn from a seeded
normal, large enough that greedy decoding differs from the base model within a few tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# kind -> LoraConfig arguments. dora, embed and modules_to_save exist to be refused; the others are servable.
KINDS: dict[str, dict[str, Any]] = {
    # rank/alpha patterns, one a plain short name, one a regex on the full module name (layer 1 only)
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL,
                     rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12},
                     alpha_pattern={"v_proj": 32, "o_proj": 4}),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "layers": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0],
                   layers_pattern="layers"),
    # target_modules as one regex that fullmatches module names
    "regex": dict(r=6, lora_alpha=12, target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj|.*\.mlp\.up_proj"),
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    "embed": dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]),
    "modules_to_save": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    # three ranks on three sets of targets (the bfloat16 closeness tests)
    "qv_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "qkvo_r16": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp_r4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
SUPPORTED_KINDS = ["patterns", "rslora", "attention", "layers", "regex"]

A_STD = 0.15  # ~ 1/sqrt(hidden 64), like peft's kaiming init of A
B_STD = 0.1  # peft's B is zero; this makes scale * B @ A a sizeable fraction of the base weights (std 0.2)


def load_base(base_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()


def write_peft_adapter(
    base_path: Path, out: Path, kind: str, seed: int = 0, *, safe_serialization: bool = True
) -> Path:
    """Write `kind` (see KINDS) for the checkpoint at base_path into out with peft's save_pretrained
    (safe_serialization=False writes the pickle adapter_model.bin instead of safetensors)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **KINDS[kind])
    model = get_peft_model(load_base(base_path), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # sorted order of named_parameters is fixed by the model, so the draw is reproducible
            if ".lora_A." in name:
                param.copy_(A_STD * torch.randn(param.shape, generator=gen))
            elif ".lora_B." in name:
                param.copy_(B_STD * torch.randn(param.shape, generator=gen))
            elif "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=safe_serialization)
    return out


def edit_config(adapter: Path, **changes: Any) -> None:
    """Rewrite fields of adapter_config.json in place (for refusal and variant tests)."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))
