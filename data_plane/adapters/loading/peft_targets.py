"""Which modules of this base model a PEFT LoraConfig adapts, with what rank and alpha.

The config's rules (TargetSpec, peft 0.21's matching) live in shared.peft, where the control plane reads
them too; here they are applied to every module name of the engine's base model.
"""

from __future__ import annotations

from data_plane.lora.errors import LoRAAdapterError
from data_plane.model.config import ModelConfig
from shared.peft import TARGET_MODULES, TargetSpec, module_name

__all__ = ["TargetSpec", "module_name", "resolve_targets"]

def resolve_targets(spec: TargetSpec, cfg: ModelConfig) -> dict[tuple[int, str], tuple[int, int | float]]:
    """(layer, short name) -> (rank, alpha) of every adapted projection; refuses other matched modules.
    Blocking (every module name is matched): the engine runs it on a reader thread or process."""
    for index in spec.layers_to_transform or []:
        if not 0 <= index < cfg.num_hidden_layers:
            raise LoRAAdapterError(
                f"layers_to_transform names layer {index}, but the base model has {cfg.num_hidden_layers} layers "
                f"(0-{cfg.num_hidden_layers - 1}); the adapter was made for another base model"
            )
    targets: dict[tuple[int, str], tuple[int, int | float]] = {}
    for key in _module_names(cfg):
        if not spec.matches(key):  # a regex RE2 cannot run is refused here (shared.peft)
            continue
        parts = key.split(".")
        if len(parts) == 5 and parts[4] in TARGET_MODULES:
            targets[(int(parts[2]), parts[4])] = spec.rank_and_alpha(key)
            continue
        if parts[-1] in ("embed_tokens", "lm_head"):
            raise LoRAAdapterError(f"LoRA on {parts[-1]} is not supported (target_modules matches {key}); "
                                   f"retrain targeting only {', '.join(TARGET_MODULES)}")
        raise LoRAAdapterError(f"target_modules matches {key}, which is not a linear projection LoRA can "
                               f"adapt; target only {', '.join(TARGET_MODULES)}")
    if not targets:
        raise LoRAAdapterError(
            f"target_modules {spec.target_modules!r} matches no module of this base model; expected names "
            f"among {', '.join(TARGET_MODULES)} (or full names such as {module_name(0, 'q_proj')})"
        )
    return targets


def _module_names(cfg: ModelConfig) -> list[str]:
    """Every module name of transformers' CausalLM for this config, so a target can match any of them."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.input_layernorm",
                  f"{p}.post_attention_layernorm"]
        names += [module_name(i, short) for short in TARGET_MODULES]
        if cfg.qk_norm:
            names += [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
    return names
