"""Validate a PEFT LoRA folder without the base model, before anything about it is recorded.

The engine checks shapes against its base when it loads; here the control plane checks what it can
alone: the path lies under an adapter root, both files exist, adapter_config.json is a LoRA config
loraplane serves (shared.peft.TargetSpec), and the safetensors header (read without
the tensor data) names exactly A/B pairs of the targeted projections with shapes consistent with the
config's ranks. Blocking file I/O: call it off the event loop.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.manifest import files_digest
from shared.peft import (
    CONFIG_NAME,
    PICKLE_NAME,
    TARGET_MODULES,
    WEIGHTS_NAME,
    AdapterFilesError,
    TargetSpec,
    layer_index,
    resolve_under_roots,
)

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
# ASCII only, as transformers names modules (and as shared.peft matches them)
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<short>\w+)$", re.ASCII)
_PARENT = {s: ("self_attn" if s.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp") for s in TARGET_MODULES}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class InspectedAdapter:
    path: str
    sha256: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    base_model_hint: str | None  # adapter_config.json's base_model_name_or_path


def inspect_adapter(path: str, roots: tuple[str, ...], *, sha256: str | None = None) -> InspectedAdapter:
    """`sha256`: the files' manifest digest when the caller hashed them already (a spool hashes as it
    writes); otherwise the files are hashed here."""
    if "\0" in path:  # the schema refuses it first; the OS would raise ValueError (a 500) on it
        raise AdapterFilesError("lora_path contains a NUL byte", param="lora_path")
    try:
        return _inspect(path, roots, sha256)
    except OSError as exc:  # unreadable (permissions), vanished mid-read, a name too long for the file system
        shown = repr(path[:128]) + ("…" if len(path) > 128 else "")
        raise AdapterFilesError(f"the adapter files in {shown} cannot be read ({exc.strerror or type(exc).__name__})",
                                param="lora_path") from None


def _inspect(path: str, roots: tuple[str, ...], sha256: str | None) -> InspectedAdapter:
    folder = _inside_roots(path, roots)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not folder.is_dir():
        raise AdapterFilesError(f"adapter path {path!r} is not a directory", param="lora_path")
    if not config_path.is_file():
        raise AdapterFilesError(f"{CONFIG_NAME} is missing in {path!r}; is this a PEFT adapter folder?",
                                param="lora_path")
    if not weights_path.is_file():
        hint = f" (only pickle {PICKLE_NAME} found; convert to safetensors)" if (folder / PICKLE_NAME).exists() else ""
        raise AdapterFilesError(f"{WEIGHTS_NAME} is missing in {path!r}{hint}", param="lora_path")
    for f in (config_path, weights_path):  # a file may itself be a symlink leading out of the roots
        _inside_roots(str(f), roots)
    config = _read_config(config_path)
    spec = TargetSpec.from_peft_config(config)  # refusals are AdapterFilesError (param lora_path)
    ranks = _check_header(_read_header(weights_path), spec)
    targets = sorted({short for _, short in ranks}, key=TARGET_MODULES.index)
    files = [config_path, weights_path]
    hint = config.get("base_model_name_or_path")
    return InspectedAdapter(
        path=str(folder), sha256=sha256 or files_digest(files), rank=max(ranks.values()), alpha=float(spec.lora_alpha),
        target_modules=targets, size_bytes=sum(f.stat().st_size for f in files),
        base_model_hint=hint if isinstance(hint, str) and hint else None,
    )


def _inside_roots(path: str, roots: tuple[str, ...]) -> Path:
    # Checked first, so a refusal never tells whether a path outside the roots exists.
    if not roots:
        raise AdapterFilesError("no adapter roots are configured (--lora-roots / LORAPLANE_LORA_ROOTS), "
                                "so no adapter path is accepted", param="lora_path")
    resolved = resolve_under_roots(path, roots)
    if resolved is None:
        raise AdapterFilesError(f"adapter path {path!r} is outside the allowed adapter roots", param="lora_path")
    return resolved


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFilesError(f"{CONFIG_NAME} is not valid JSON ({exc})", param="lora_path") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterFilesError(f"{CONFIG_NAME} is not a LoRA config (peft_type must be \"LORA\")",
                                param="lora_path")
    return config


def _read_header(weights_path: Path) -> dict[str, Any]:
    size = weights_path.stat().st_size
    with weights_path.open("rb") as fh:
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise AdapterFilesError(f"{WEIGHTS_NAME} has no valid safetensors header", param="lora_path")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise AdapterFilesError(f"{WEIGHTS_NAME} has a corrupt safetensors header", param="lora_path") from None
    if not isinstance(header, dict):
        raise AdapterFilesError(f"{WEIGHTS_NAME} has a corrupt safetensors header", param="lora_path")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for key, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise AdapterFilesError(f"tensor {key} in {WEIGHTS_NAME} lies outside the file (truncated?)",
                                    param="lora_path")
        if info.get("dtype") not in _FLOAT_DTYPES:
            raise AdapterFilesError(f"tensor {key} has dtype {info.get('dtype')}; LoRA weights must be floating point",
                                    param="lora_path")
    return header


def _check_header(header: dict[str, Any], spec: TargetSpec) -> dict[tuple[int, str], int]:
    """(layer, short) -> rank, after checking names, pairing and shapes against the config."""
    shapes: dict[tuple[int, str, str], list[int]] = {}
    for key, info in header.items():
        m = _KEY.match(key)
        mod = _MODULE.match(m["module"]) if m else None
        if not mod or _PARENT.get(mod["short"]) != mod["parent"]:
            raise AdapterFilesError(f"tensor {key} is not a LoRA A/B weight of a decoder projection "
                                    f"({'/'.join(TARGET_MODULES)})", param="lora_path")
        if not spec.matches(m["module"]):
            raise AdapterFilesError(f"tensor {key} is for a module {CONFIG_NAME} does not target", param="lora_path")
        layer = layer_index(mod["layer"])
        if layer is None:
            raise AdapterFilesError(f"tensor {key[:200]}… names a layer index of {len(mod['layer'])} digits; no "
                                    "model has that many layers", param="lora_path")
        shapes[(layer, mod["short"], m["ab"])] = list(info.get("shape", []))
    ranks: dict[tuple[int, str], int] = {}
    for layer, short, _ in shapes:
        a, b = shapes.get((layer, short, "lora_A")), shapes.get((layer, short, "lora_B"))
        name = f"model.layers.{layer}.{_PARENT[short]}.{short}"
        if a is None or b is None:
            raise AdapterFilesError(f"{name} lacks {'lora_A' if a is None else 'lora_B'} in {WEIGHTS_NAME}",
                                    param="lora_path")
        rank = spec.rank_and_alpha(name)[0]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterFilesError(f"{name} has lora_A {a} and lora_B {b}, expected rank {rank} from {CONFIG_NAME}",
                                    param="lora_path")
        ranks[(layer, short)] = rank
    if not ranks:
        raise AdapterFilesError(f"{WEIGHTS_NAME} holds no LoRA weights", param="lora_path")
    return ranks
