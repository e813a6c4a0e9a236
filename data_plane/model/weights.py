"""Maps Hugging Face checkpoint tensors onto the llama-family model's (fused, sharded) parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from data_plane.model.layers.parallel import ShardId, default_weight_loader
from shared.errors import UnsupportedModelError

# (fused parameter, HF projection, shard id): q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj
STACKED_PARAMS: list[tuple[str, str, ShardId]] = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]
# buffers some older checkpoints saved; recomputed from the config
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_NAMES_IN_MESSAGE = 20


def hf_names_of(param_name: str) -> list[str]:
    """The checkpoint tensor names that fill one of our parameters."""
    names = [param_name.replace(fused, hf) for fused, hf, _ in STACKED_PARAMS if fused in param_name]
    return names or [param_name]


def to_param_name(hf_name: str) -> tuple[str, ShardId]:
    """Checkpoint tensor name -> (our parameter name, shard id or None)."""
    for fused, hf, shard_id in STACKED_PARAMS:
        if hf in hf_name:
            return hf_name.replace(hf, fused), shard_id
    return hf_name, None


def load_llama_weights(
    params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]], *, tied: bool, architecture: str
) -> None:
    """`params` from model.named_parameters(): a tied lm_head.weight is the embedding's and not listed again."""
    expected = {hf for name in params for hf in hf_names_of(name)}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue  # a tied checkpoint may or may not ship the (identical) head
        param_name, shard_id = to_param_name(name)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise UnsupportedModelError(f"checkpoint tensor {name}: {e}") from e
        loaded.add(name)
    missing = sorted(expected - loaded)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_name_list(sorted(unexpected))}")
    if problems:
        raise UnsupportedModelError(f"checkpoint does not match {architecture}: " + "; ".join(problems))


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
    more = len(names) - _MAX_NAMES_IN_MESSAGE
    return f"{shown} … and {more} more" if more > 0 else shown
