"""Builds the model in its target dtype on its target device and streams safetensors weights into it.

Parameters are allocated once, uninitialized, directly where they live; checkpoint tensors are
memory-mapped and copied one at a time, so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from data_plane.model.attention_kernels import select_decode_attention, use_decode_attention
from data_plane.model.config import ModelConfig
from data_plane.model.layers.cpu_weights import prepare_cpu_weights
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.norm_kernels import select_norm_kernel, use_norm_kernel
from shared.errors import UnsupportedModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 100 * 1024 * 1024  # below this loading is instant; a bar would only be noise


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """"auto" = the checkpoint's dtype (float32 if the config does not say); else one of DTYPES."""
    name = (config.dtype or "float32") if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UnsupportedModelError(f"{model_dir}: shards listed in the index are missing: {', '.join(absent)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")):
        raise UnsupportedModelError(
            f"{model_dir} has only PyTorch .bin weights; convert them to safetensors "
            "(e.g. model.save_pretrained(dir, safe_serialization=True))"
        )
    raise UnsupportedModelError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every file, with a progress bar for large checkpoints."""
    total_bytes = sum(f.stat().st_size for f in files)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    # safetensors' stub leaves keys() unannotated; noqa: safe_open is not a dict
    keys = [(h, k) for h in handles for k in h.keys()]  # type: ignore[no-untyped-call]  # noqa: SIM118
    disable = total_bytes < _PROGRESS_MIN_BYTES or not sys.stderr.isatty()
    for handle, key in tqdm(keys, desc="Loading weights", unit="tensor", disable=disable):
        yield key, handle.get_tensor(key)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: Path,
    dtype: str = "auto",
    device: torch.device = torch.device("cpu"),  # noqa: B008 (an immutable value)
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    files = safetensors_files(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    # parameters are created uninitialized in the target dtype on the target device (no fp32 or CPU copy);
    # the rotary cache stays float32 because it is built with an explicit dtype
    with _default_dtype(torch_dtype), torch.device(device):
        model = LlamaForCausalLM(config, tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(iter_safetensors(files))
    if torch.device(device).type == "cpu":
        prepare_cpu_weights(model)
    use_decode_attention(model, select_decode_attention(torch.device(device)))
    use_norm_kernel(model, select_norm_kernel(torch.device(device), torch_dtype))
    return model.eval(), config
