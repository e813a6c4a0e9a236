"""Validate a PEFT LoRA folder without the base model, before anything about it is recorded.

The engine checks shapes against its base when it loads; here the control plane checks what it can
alone: the path lies under an adapter root, both files exist, adapter_config.json is a LoRA config
loraplane serves (shared.peft.TargetSpec), and the safetensors header (read without
the tensor data) names exactly A/B pairs of the targeted projections with shapes consistent with the
config's ranks. The header is checked as safetensors checks it (shared.safetensors_header: every tensor's
data inside the file, the data tiled without gap or overlap), so a file the engine would refuse as
truncated or corrupt is refused before anything is recorded. Blocking file I/O: call it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.engine_admin import AdapterDescription
from shared.manifest import files_digest
from shared.peft import (
    CONFIG_NAME,
    PICKLE_NAME,
    TARGET_MODULES,
    WEIGHTS_NAME,
    AdapterFilesError,
    TargetSpec,
    module_name,
    parse_lora_key,
    read_config,
    resolve_under_roots,
)
from shared.safetensors_header import DTYPES, HeaderError, TensorInfo, read_header


@dataclass(frozen=True)
class InspectedAdapter:
    path: str
    description: AdapterDescription
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
    config = read_config(config_path.read_bytes())
    spec = TargetSpec.from_peft_config(config)  # refusals are AdapterFilesError (param lora_path)
    ranks = _check_tensors(_read_tensors(weights_path), spec)
    targets = sorted({short for _, short in ranks}, key=TARGET_MODULES.index)
    files = [config_path, weights_path]
    base_hint = config.get("base_model_name_or_path")
    description = AdapterDescription(
        sha256=sha256 or files_digest(files), rank=max(ranks.values()), alpha=float(spec.lora_alpha),
        target_modules=targets, size_bytes=sum(f.stat().st_size for f in files))
    return InspectedAdapter(path=str(folder), description=description,
                            base_model_hint=base_hint if isinstance(base_hint, str) and base_hint else None)


def _inside_roots(path: str, roots: tuple[str, ...]) -> Path:
    # Checked first, so a refusal never tells whether a path outside the roots exists.
    if not roots:
        raise AdapterFilesError("no adapter roots are configured (--lora-roots / LORAPLANE_LORA_ROOTS), "
                                "so no adapter path is accepted", param="lora_path")
    resolved = resolve_under_roots(path, roots)
    if resolved is None:
        raise AdapterFilesError(f"adapter path {path!r} is outside the allowed adapter roots", param="lora_path")
    return resolved


def _read_tensors(weights_path: Path) -> dict[str, TensorInfo]:
    """The header, checked as safetensors checks it (the data's offsets included), and every tensor a float."""
    try:
        tensors = read_header(weights_path)
    except HeaderError as exc:
        raise AdapterFilesError(f"{WEIGHTS_NAME} is not a valid safetensors file: {exc}; save the adapter again",
                                param="lora_path") from None
    for key, info in tensors.items():
        if not DTYPES[info.dtype].floating:
            raise AdapterFilesError(f"tensor {key} has dtype {info.dtype}; LoRA weights must be floating point",
                                    param="lora_path")
    return tensors


def _check_tensors(tensors: dict[str, TensorInfo], spec: TargetSpec) -> dict[tuple[int, str], int]:
    """(layer, short) -> rank, after checking names, pairing and shapes against the config."""
    shapes: dict[tuple[int, str, str], list[int]] = {}
    for key, info in tensors.items():
        parsed = parse_lora_key(key)
        if parsed is None or parsed.short is None:
            raise AdapterFilesError(f"tensor {key} is not a LoRA A/B weight of a decoder projection "
                                    f"({'/'.join(TARGET_MODULES)})", param="lora_path")
        if not spec.matches(parsed.module):
            raise AdapterFilesError(f"tensor {key} is for a module {CONFIG_NAME} does not target", param="lora_path")
        layer = parsed.layer
        if layer is None:
            raise AdapterFilesError(f"tensor {key[:200]}… names a layer index of {len(parsed.digits or '')} digits; "
                                    "no model has that many layers", param="lora_path")
        shapes[(layer, parsed.short, parsed.ab)] = list(info.shape)
    ranks: dict[tuple[int, str], int] = {}
    for layer, short, _ in shapes:
        a, b = shapes.get((layer, short, "lora_A")), shapes.get((layer, short, "lora_B"))
        name = module_name(layer, short)
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
