"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) and validate it against the base.

Blocking file I/O: the caller runs it off the engine loop. Every refusal is a LoRAAdapterError that names
the cause and what to do; the cheap checks (location, files, config, rank) come before any tensor is read.
Module matching follows peft 0.21 (`check_target_module_exists`, `get_pattern_key`) so that an adapter
targets here exactly the modules it targets under transformers + peft.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from data_plane.adapters.artifacts.buffers import Buffer
from data_plane.adapters.artifacts.download import Stage
from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.loading.peft_targets import TargetSpec, module_name, resolve_targets
from data_plane.adapters.loading.safetensors_memory import all_finite, open_tensors
from data_plane.adapters.loading.shared_tensors import allocate
from data_plane.adapters.loading.staging import TensorStage
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.shared_layout import TensorKey
from data_plane.lora.weights import TARGET_MODULES, LoRAAdapterWeights, LoRAModuleWeights
from data_plane.model.config import ModelConfig
from shared.engine_admin import AdapterDescription
from shared.manifest import ManifestEntry, entries_of, manifest_digest
from shared.peft import (
    CONFIG_NAME,
    PICKLE_NAME,
    WEIGHTS_NAME,
    LoraKey,
    parse_lora_key,
    read_config,
    resolve_under_roots,
)


def load_peft_adapter(
    path: str | Path,
    model_config: ModelConfig,
    *,
    max_rank: int,
    allowed_roots: list[str],
    dtype: torch.dtype = torch.float32,
    verified: VerifiedFiles | None = None,
    pace: Callable[[], None] | None = None,
) -> LoRAAdapterWeights:
    """Validate and read the adapter at `path`; per layer and projection A [r, in], B [out, r] and scale.
    `verified` (data_plane.adapters.artifacts.verified_files): what the engine verified itself. Files whose
    verified bytes it still holds are read from memory (a version just fetched: nothing is read from disk);
    a weights file it hashed and that is unchanged since is not hashed again. `pace`: called after each
    tensor read or copied and each MiB hashed (an adapter reader rests there while the engine serves)."""
    if "\0" in str(path):  # the OS would raise ValueError (a 500) on it
        raise LoRAAdapterError("lora_path contains a NUL byte; pass the adapter folder's path")
    try:
        folder = _resolve_inside_roots(path, allowed_roots)
        held = held_files(folder, verified)
        weights: Path | Buffer  # the weights file's held bytes, else its path
        weights_sha256: str | None
        if held is not None:
            config_bytes, (weights_sha256, weights) = held
            weights_path = folder / WEIGHTS_NAME
        else:
            config_path, weights_path = _locate_files(folder, path, allowed_roots)
            config_bytes = config_path.read_bytes()
            weights, weights_sha256 = weights_path, verified.sha256_of(weights_path) if verified else None
        config = read_config(config_bytes)
    except OSError as exc:  # a name too long for the file system, permissions, a file vanishing
        shown = repr(str(path)[:128]) + ("…" if len(str(path)) > 128 else "")
        raise LoRAAdapterError(f"adapter path {shown} cannot be read ({exc.strerror or type(exc).__name__}); "
                               "pass the folder peft's save_pretrained wrote") from None
    # held bytes of a fetched version: the host copy made as they arrived, if any (taken by one load)
    stage = verified.take_stage(weights_path) if held is not None and verified is not None else None
    try:
        return _load(folder, config_bytes, weights, weights_path, weights_sha256, config, model_config, max_rank,
                     dtype, stage, pace or _no_pace)
    finally:
        if stage is not None:
            stage.discard()  # a no-op once adopted (the file is the weights' then); else nothing is left of it


def _load(
    folder: Path, config_bytes: bytes, weights: Path | Buffer, weights_path: Path, weights_sha256: str | None,
    config: dict[str, Any], model_config: ModelConfig, max_rank: int, dtype: torch.dtype,
    stage: Stage | None, pace: Callable[[], None],
) -> LoRAAdapterWeights:
    spec = TargetSpec.from_peft_config(config)
    targets = resolve_targets(spec, model_config)  # (layer, short) -> (rank, alpha)
    rank = max(r for r, _ in targets.values())
    if rank > max_rank:
        worst = next(k for k, (r, _) in targets.items() if r == rank)
        raise LoRAAdapterError(
            f"rank {rank} (module {module_name(*worst)}) exceeds --max-lora-rank {max_rank}; "
            "restart the engine with a larger --max-lora-rank or use an adapter of lower rank"
        )
    loaded = _read_tensors(weights, targets, model_config, pace)
    # The host copy: one shared-memory file (shared_tensors.py) that the engine-core process maps as it is,
    # written once, in the slots' input-major layout: made while the bytes arrived (a fetched version's
    # stage, adopted if it holds exactly these tensors), or here. It is removed on any refusal from now on.
    shapes = _input_major_shapes(loaded)
    staged = stage.adopt({(layer, short, HOST_PART[ab]): name for (layer, short, ab), (name, _) in loaded.items()},
                         shapes, dtype) if isinstance(stage, TensorStage) else None  # (another kind: not adopted)
    if staged is not None:
        views, shared, finite = staged.views, staged.layout, staged.finite
    else:
        (views, shared), finite = allocate(shapes, dtype), None
    try:
        _check_and_copy(loaded, targets, views, finite, pace)
        layers: dict[int, dict[str, LoRAModuleWeights]] = {}
        for (layer, short), (r, alpha) in sorted(targets.items()):
            scaling = alpha / math.sqrt(r) if spec.use_rslora else alpha / r
            # A and B as PEFT stores them, transposed views of the file's A^T and B^T: the dataclass finds
            # those contiguous already and copies nothing
            a_t, b_t = views[(layer, short, "a_t")], views[(layer, short, "b_t")]
            layers.setdefault(layer, {})[short] = LoRAModuleWeights(lora_a=a_t.T, lora_b=b_t.T, scaling=scaling)
        # The version's identity is the manifest digest (shared.manifest), the same the control plane records:
        # the config's entry is taken from the very bytes parsed above, so what is served is what is named.
        if weights_sha256 is None:
            weights_entry = entries_of([weights_path], pace)[0]
        else:
            size = weights_path.stat().st_size if isinstance(weights, Path) else len(weights)
            weights_entry = ManifestEntry(WEIGHTS_NAME, size, weights_sha256)
        entries = [ManifestEntry(CONFIG_NAME, len(config_bytes), hashlib.sha256(config_bytes).hexdigest()),
                   weights_entry]
        description = AdapterDescription(
            sha256=manifest_digest(entries), rank=rank, alpha=float(spec.lora_alpha),
            target_modules=sorted({s for _, s in targets}, key=TARGET_MODULES.index),
            size_bytes=sum(e.size for e in entries),
        )
        return LoRAAdapterWeights(path=str(folder), description=description, layers=layers, shared=shared)
    except BaseException:
        shared.remove()
        raise


def _no_pace() -> None:
    pass


def _resolve_inside_roots(path: str | Path, allowed_roots: list[str]) -> Path:
    # Checked before anything else, so the reply never tells whether a path outside the roots exists.
    if not allowed_roots:
        raise LoRAAdapterError(
            "no LoRA roots are configured, so no adapter path is allowed; start the engine with "
            "--lora-roots DIR [DIR ...] naming the directories adapters may be loaded from"
        )
    resolved = resolve_under_roots(path, allowed_roots)
    if resolved is None:
        raise LoRAAdapterError(
            f"adapter path {str(path)!r} is outside the allowed LoRA roots ({', '.join(allowed_roots)}); "
            "put the adapter under one of them or add its directory to --lora-roots"
        )
    return resolved


def held_files(folder: Path, verified: VerifiedFiles | None) -> tuple[bytes, tuple[str, Buffer]] | None:
    """(config bytes, (weights sha256, weights bytes)) when `verified` holds both files' checked bytes."""
    if verified is None:
        return None
    config, weights = verified.contents_of(folder / CONFIG_NAME), verified.contents_of(folder / WEIGHTS_NAME)
    if config is None or weights is None:
        return None
    return bytes(config[1]), weights


def _locate_files(folder: Path, given: str | Path, allowed_roots: list[str]) -> tuple[Path, Path]:
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise LoRAAdapterError(f"adapter path {str(given)!r} {what}; pass the folder peft's save_pretrained wrote")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_path.is_file():
        raise LoRAAdapterError(f"{CONFIG_NAME} is missing in {str(given)!r}; is this a PEFT adapter folder?")
    if not weights_path.is_file():
        if (folder / PICKLE_NAME).is_file():
            raise LoRAAdapterError(
                f"{str(given)!r} holds only {PICKLE_NAME}: pickle .bin weights are not loaded; convert to "
                "safetensors (e.g. peft's save_pretrained(..., safe_serialization=True))"
            )
        raise LoRAAdapterError(f"{WEIGHTS_NAME} is missing in {str(given)!r}; save the adapter with peft")
    # A file inside the folder may itself be a symlink leading out of the roots.
    for f in (config_path, weights_path):
        if resolve_under_roots(f, allowed_roots) is None:
            raise LoRAAdapterError(
                f"{f.name} in {str(given)!r} links outside the allowed LoRA roots; copy the file instead"
            )
    return config_path, weights_path


Loaded = dict[tuple[int, str, str], tuple[str, torch.Tensor]]  # (layer, short, "lora_A"/"lora_B") -> (name, tensor)
# each PEFT tensor's part of the host copy: A [r, in] is stored as a_t [in, r], B [out, r] as b_t [r, out]
HOST_PART = {"lora_A": "a_t", "lora_B": "b_t"}


def _read_tensors(
    weights: Path | Buffer, targets: dict[tuple[int, str], tuple[int, int | float]], cfg: ModelConfig,
    pace: Callable[[], None],
) -> Loaded:
    """Check every tensor name and shape from the header, then read the tensors (not yet checked).
    `weights`: the file, or its verified bytes in memory (the tensors are then views of them)."""
    try:
        with open_tensors(weights) as f:
            shapes = {key: f.shape(key) for key in f.keys()}  # noqa: SIM118
            keys = _check_names_and_shapes(shapes, targets, cfg)
            loaded: Loaded = {}
            for ours, key in keys.items():
                loaded[ours] = (key, f.get_tensor(key))
                pace()
            return loaded
    except (SafetensorError, OSError) as exc:  # a bad header, offsets past the end, an unreadable file
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME} is corrupt or truncated and cannot be read ({type(exc).__name__}: {exc}); "
            "copy or save the adapter again"
        ) from None


def _input_major_shapes(loaded: Loaded) -> dict[TensorKey, list[int]]:
    """The slots' layout of each tensor: A [r, in] -> a_t [in, r], B [out, r] -> b_t [r, out]."""
    return {(layer, short, HOST_PART[ab]): list(tensor.shape)[::-1] for (layer, short, ab), (_, tensor) in loaded.items()}


def _check_and_copy(
    loaded: Loaded, targets: dict[tuple[int, str], tuple[int, int | float]], views: dict[TensorKey, torch.Tensor],
    staged_finite: dict[TensorKey, bool] | None, pace: Callable[[], None],
) -> None:
    """Refuse what cannot be served, else copy each tensor transposed (and cast) into its view: one pass.
    `staged_finite`: the views hold the copies already, made (and checked for NaN/inf) as the bytes arrived."""
    for layer, short in targets:
        for ab, part in HOST_PART.items():
            key, tensor = loaded[(layer, short, ab)]
            if not tensor.is_floating_point():
                raise LoRAAdapterError(f"tensor {key} has dtype {tensor.dtype}; LoRA weights must be floating point")
            finite = staged_finite[(layer, short, part)] if staged_finite is not None else all_finite(tensor)
            if not finite:
                raise LoRAAdapterError(f"tensor {key} contains NaN or infinite values; the adapter is broken")
            if staged_finite is None:
                views[(layer, short, part)].copy_(tensor.T)
            pace()


def _check_names_and_shapes(
    shapes: dict[str, list[int]], targets: dict[tuple[int, str], tuple[int, int | float]], cfg: ModelConfig,
) -> dict[tuple[int, str, str], str]:
    """(layer, short, "lora_A"/"lora_B") -> tensor name, for exactly the targeted modules."""
    keys: dict[tuple[int, str, str], str] = {}
    for key in sorted(shapes):
        parsed = _parse_key(key)
        module, ab, short, layer = parsed.module, parsed.ab, parsed.short, parsed.layer
        if short is None:
            raise LoRAAdapterError(
                f"tensor {key} is for module {module}, which loraplane cannot adapt; only the "
                f"{'/'.join(TARGET_MODULES)} projections of the decoder layers are supported"
            )
        if layer is None or layer >= cfg.num_hidden_layers:
            raise LoRAAdapterError(
                f"tensor {key} is for layer {parsed.digits if layer is None else layer}, but the base model has "
                f"{cfg.num_hidden_layers} layers "
                f"(0-{cfg.num_hidden_layers - 1}); the adapter was made for another base model"
            )
        if (layer, short) not in targets:
            raise LoRAAdapterError(
                f"tensor {key} is for {module}, which {CONFIG_NAME} does not target (target_modules, "
                "layers_to_transform); the config and the weights do not belong together"
            )
        if (layer, short, ab) in keys:
            raise LoRAAdapterError(f"tensors {keys[(layer, short, ab)]} and {key} are both {ab} of {module}")
        in_features, out_features = _features(short, cfg)
        rank = targets[(layer, short)][0]
        expected = [rank, in_features] if ab == "lora_A" else [out_features, rank]
        if shapes[key] != expected:
            raise LoRAAdapterError(
                f"tensor {key} has shape {shapes[key]}, expected {expected} (rank {rank} from {CONFIG_NAME}, "
                f"{short} of this base model is {in_features} -> {out_features}); was the adapter trained "
                "for another base model?"
            )
        keys[(layer, short, ab)] = key
    for layer, short in sorted(targets):
        has_a, has_b = (layer, short, "lora_A") in keys, (layer, short, "lora_B") in keys
        if has_a != has_b:
            present, absent = ("lora_A", "lora_B") if has_a else ("lora_B", "lora_A")
            raise LoRAAdapterError(
                f"{module_name(layer, short)} has {present} but no {absent} in {WEIGHTS_NAME}; the file is incomplete"
            )
        if not has_a:
            raise LoRAAdapterError(
                f"{CONFIG_NAME} targets {module_name(layer, short)} but {WEIGHTS_NAME} has no weights for it; "
                "the config and the weights do not belong together"
            )
    return keys


def _parse_key(key: str) -> LoraKey:
    parsed = parse_lora_key(key)
    if parsed is not None:
        return parsed
    # Name what the tensor is, since the config checks may have been passed by a hand-edited config.
    if "lora_magnitude_vector" in key:
        cause = "a DoRA magnitude vector (use_dora is not supported)"
    elif "lora_embedding_" in key:
        cause = "a LoRA on an embedding (embed_tokens is not supported)"
    elif ".lora_B." in key and key.endswith(".bias"):
        cause = "a LoRA bias (lora_bias is not supported)"
    else:
        cause = "not a LoRA A/B weight (modules_to_save or a full layer copy is not supported)"
    raise LoRAAdapterError(f"tensor {key} in {WEIGHTS_NAME} is {cause}; retrain or re-save as plain LoRA")


def _features(short: str, cfg: ModelConfig) -> tuple[int, int]:
    """(in_features, out_features) of a projection, as nn.Linear stores it: weight [out, in]."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }[short]
