"""The PEFT LoRA folder format, as both halves read it: file names, adapter_config.json (`read_config`), the
tensor names (`parse_lora_key`), the projections loraplane adapts, and which modules a LoraConfig targets
with what rank and alpha (peft 0.21's rules, without peft or torch).

The rules mirrored (peft/tuners/tuners_utils.py `check_target_module_exists`, peft/utils/other.py
`get_pattern_key`), applied to the module names transformers gives a Llama-family CausalLM:
- target_modules as a string is a regex that must fullmatch the module name; as a list, an entry matches a
  module whose name equals it or ends with "." + it; then layers_to_transform filters by layer index;
- rank_pattern / alpha_pattern keys are regexes matched as `(.*\\.)?(key)$`, the first matching key wins.
Every regex, the config's and those built around its values, runs on RE2 (shared.regex): what Python's `re`
means by it, matched in linear time; one RE2 cannot run is refused (AdapterFilesError naming the field).
The engine checks the config against its base model (resolve_targets, data_plane/adapters/loading/
peft_targets.py); the control plane checks what it can without one (control_plane.artifacts.inspect).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from shared.errors import InvalidRequestError
from shared.regex import LinearRegex, RegexError, compile_regex

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
# Hugging Face projection names that loraplane can adapt, and where each lands in the fused layers.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterFilesError(InvalidRequestError):
    """The adapter at the given path cannot be served (files, format, shape, rank, location): the
    request's `lora_path` is what is wrong, unless the raiser names another field."""

    def __init__(self, message: str, *, param: str | None = "lora_path", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for llama, mistral, qwen2 and qwen3
_DEFAULT_TARGETS = ["q_proj", "v_proj"]

# Config fields that change what the adapter computes beyond scale * B @ A (peft LoRA "variants" and the
# like): served wrongly if ignored, so refused. Each value is what the user is told the field means.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (full copies of layers)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer_replication",
    "lora_bias": "a LoRA bias (lora_bias)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# These initialisations rewrite the base weights: the adapter only works on the base saved with it.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
_FIRST_INDEX = compile_regex(r".*?\.[^.]*\.(?P<idx>\d+)\.")  # peft's layer index without layers_pattern
_SHOWN_CHARS = 200  # of a refused value (a regex, a peft_type), in the error


def resolve_under_roots(path: str | Path, roots: Iterable[str]) -> Path | None:
    """`path` with `~`, symlinks and `..` resolved, if that lies under one of `roots`; None otherwise,
    also when it cannot be resolved at all (`~nosuchuser`, a symlink loop): the caller refuses it the
    same way, so a refusal never tells whether something outside the roots exists."""
    try:
        resolved = Path(path).expanduser().resolve()
    except (RuntimeError, OSError, ValueError):
        return None
    for root in roots:
        try:
            if resolved.is_relative_to(Path(root).expanduser().resolve()):
                return resolved
        except (RuntimeError, OSError, ValueError):
            continue
    return None


def layer_index(digits: str) -> int | None:
    """The layer index a module name spells with `digits`; None for one no model has (past 18 digits, where
    int() would also refuse a long enough run of them)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else None


def module_name(layer: int, short: str) -> str:
    """The module's name in transformers' Llama-family CausalLM, as peft matches it."""
    return f"model.layers.{layer}.{_parent(short)}.{short}"


def _parent(short: str) -> str:
    return "self_attn" if short in _ATTENTION else "mlp"


def read_config(data: bytes) -> dict[str, Any]:
    """adapter_config.json's bytes as a dict: a JSON object whose peft_type is "LORA", else
    AdapterFilesError. Its other fields are TargetSpec.from_peft_config's to check."""
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # the message gives a position, never the text
        raise AdapterFilesError(f"{CONFIG_NAME} is not valid JSON ({exc}); re-save the adapter with peft") from None
    except (ValueError, RecursionError):  # an integer of over 4300 digits, nesting too deep for Python's json
        raise AdapterFilesError(f"{CONFIG_NAME} cannot be parsed (a number too long or nesting too deep); "
                                "re-save the adapter with peft") from None
    if not isinstance(config, dict):
        raise AdapterFilesError(f"{CONFIG_NAME} must hold a JSON object; re-save the adapter with peft")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterFilesError(f"peft_type {_shown(repr(peft_type))} is not supported; only LoRA adapters "
                                "(peft_type \"LORA\") can be served")
    return config


# peft saves `base_model.model.<module>.lora_A.weight`; in-memory state dicts also carry the adapter name.
# ASCII only, as transformers names modules (and as TargetSpec matches them).
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_PROJECTION = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<short>\w+)$", re.ASCII)


class LoraKey(NamedTuple):
    """A PEFT LoRA tensor name, parsed. `short` (one of TARGET_MODULES) and `digits` (the layer index as
    the name spells it) are set when the module is a decoder layer's projection loraplane adapts."""

    module: str  # the module's name, as TargetSpec.matches takes it
    ab: str  # "lora_A" | "lora_B"
    short: str | None
    digits: str | None

    @property
    def layer(self) -> int | None:
        """The layer index; None when there is none, or more digits than any model has layers."""
        return None if self.digits is None else layer_index(self.digits)


def parse_lora_key(key: str) -> LoraKey | None:
    """`base_model.model.<module>.lora_A|lora_B[.<adapter name>].weight`, parsed; None for any other name."""
    m = _LORA_KEY.match(key)
    if m is None:
        return None
    p = _PROJECTION.match(m["module"])
    if p is None or p["short"] not in TARGET_MODULES or _parent(p["short"]) != p["parent"]:
        return LoraKey(m["module"], m["ab"], None, None)
    return LoraKey(m["module"], m["ab"], p["short"], p["layer"])


@dataclass(frozen=True)
class TargetSpec:
    """The fields of a peft LoraConfig that decide which modules are adapted and how strongly."""

    r: int
    lora_alpha: int | float
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: list[int] | None
    layers_pattern: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, int | float]
    use_rslora: bool
    # each regex compiled once for this config (matching visits every module name)
    _regexes: dict[str, LinearRegex] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_peft_config(cls, config: dict[str, Any]) -> TargetSpec:
        """Parse adapter_config.json (already known to be LoRA), refusing what loraplane cannot serve."""
        for name, what in _UNSUPPORTED_FIELDS.items():
            if config.get(name):
                raise AdapterFilesError(f"the adapter uses {what}, which loraplane does not serve; "
                                       "retrain or re-save it as a plain LoRA adapter")
        if config.get("bias", "none") != "none":
            raise AdapterFilesError(f"bias {config['bias']!r} is not supported (base-layer biases would change); "
                                   "only bias \"none\" adapters can be served")
        init = str(config.get("init_lora_weights", True)).lower()
        if init.startswith(_BASE_CHANGING_INITS):
            raise AdapterFilesError(
                f"init_lora_weights {init!r} changes the base weights, so this adapter needs its own base; "
                "convert it to plain LoRA (save_pretrained(path_initial_model_for_weight_conversion=...))"
            )
        r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
        if not _is_int(r) or r <= 0 or not _is_number(alpha):
            raise AdapterFilesError(f"r must be a positive integer and lora_alpha a number, got {r!r}, {alpha!r}")
        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        if not all(_is_int(v) and v > 0 for v in rank_pattern.values()):
            raise AdapterFilesError("rank_pattern values must be positive integers")
        if not all(_is_number(v) for v in alpha_pattern.values()):
            raise AdapterFilesError("alpha_pattern values must be numbers")
        targets = config.get("target_modules")
        if targets is None:
            targets = _DEFAULT_TARGETS
        elif isinstance(targets, str) and targets.lower() == "all-linear":
            targets = list(TARGET_MODULES)  # peft expands it to every linear layer but the output head
        layers = config.get("layers_to_transform")
        pattern = config.get("layers_pattern")
        return cls(
            r=r, lora_alpha=alpha, target_modules=targets, exclude_modules=config.get("exclude_modules"),
            layers_to_transform=[layers] if isinstance(layers, int) else (layers or None),
            layers_pattern=[pattern] if isinstance(pattern, str) and pattern else (pattern or None),
            rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, use_rslora=bool(config.get("use_rslora")),
        )

    def matches(self, key: str) -> bool:
        """peft's check_target_module_exists for one module name (modules_to_save is refused earlier).
        `key`: a module name (ASCII, as transformers names modules); blocking: call it off the event loop."""
        excluded = self.exclude_modules
        if isinstance(excluded, str):
            if self._regex(excluded, "exclude_modules").fullmatch(key):
                return False
        elif excluded and (key in excluded or any(key.endswith(f".{e}") for e in excluded)):
            return False
        if isinstance(self.target_modules, str):
            return self._regex(self.target_modules, "target_modules").fullmatch(key)
        if key in self.target_modules:
            return True  # an exact full name is taken as it is, without the layer filter
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        if self.layers_pattern is None:
            m = _FIRST_INDEX.match(key)  # the first numbered segment
        else:
            m = next(filter(None, (self._regex(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern", p).match(key)
                                   for p in self.layers_pattern)), None)
        if m is None or (digits := m["idx"]) is None:
            return False
        index = layer_index(digits)
        return index is not None and index in self.layers_to_transform

    def rank_and_alpha(self, key: str) -> tuple[int, int | float]:
        """peft's rank and alpha of module `key` (as `matches`, ASCII; off the event loop)."""
        rank = self._pattern_value("rank_pattern", key, self.r)
        return rank, self._pattern_value("alpha_pattern", key, self.lora_alpha)

    def _pattern_value(self, name: str, key: str, default: Any) -> Any:
        for pattern_key, value in getattr(self, name).items():
            if self._regex(rf"(.*\.)?({pattern_key})$", name, pattern_key).match(key) is not None:
                return value
        return default

    def _regex(self, pattern: str, name: str, shown: str | None = None) -> LinearRegex:
        """`pattern`, built from the config's field `name` (its value there: `shown`), compiled for RE2."""
        compiled = self._regexes.get(pattern)
        if compiled is None:
            try:
                compiled = self._regexes[pattern] = compile_regex(pattern)
            except RegexError as exc:
                text = _shown(pattern if shown is None else shown)
                raise AdapterFilesError(f"the regex {text!r} in {name} of {CONFIG_NAME} {exc}; rewrite it, or "
                                        "list the module names instead") from None
        return compiled


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
