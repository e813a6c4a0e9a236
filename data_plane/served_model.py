"""What an engine tells the control plane it serves, beyond its served model name.

An adapter names its base model as its adapter_config.json does (`base_model_name_or_path`: a hub id
or the path it was trained against), rarely as an engine's --served-model-name. So the engine
registers every name its base model goes by: the checkpoint's `_name_or_path` (config.json), the
model folder it loaded, and the sha256 of config.json's bytes (two copies of one checkpoint match
wherever they lie). With them it registers what it can hold: the device it runs on, the LoRA rank
its slots are padded to, its host cache's slots (its device slots are `slots_total`) and its context
length (routers reserve a tenant's tokens by it when a request sets no max_tokens).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from data_plane.config import EngineConfig

MAX_NAME = 1024  # shared.engine_admin.EngineRegistration's bounds
MAX_PATH = 4096


@dataclass(frozen=True)
class ServedModel:
    model_name_or_path: str | None
    model_path: str | None
    config_digest: str
    device_kind: str | None
    max_lora_rank: int | None  # None with LoRA off
    max_cpu_loras: int | None
    max_model_len: int | None  # None before the config is finalized (the model loaded)


def served_model(config: EngineConfig, device_kind: str | None) -> ServedModel:
    """Read off the model folder's config.json (EngineConfig checked that it is there) and the config."""
    raw = Path(config.model, "config.json").read_bytes()
    try:
        name = json.loads(raw).get("_name_or_path")
    except (ValueError, AttributeError):  # not a JSON object: the model loader would have refused it
        name = None
    path = str(Path(config.model).resolve())
    lora = config.enable_lora
    return ServedModel(
        model_name_or_path=name if isinstance(name, str) and 0 < len(name) <= MAX_NAME else None,
        model_path=path if len(path) <= MAX_PATH else None,
        config_digest=hashlib.sha256(raw).hexdigest(),
        device_kind=device_kind,
        max_lora_rank=config.max_lora_rank if lora else None,
        max_cpu_loras=config.max_cpu_loras if lora else None,
        max_model_len=config.max_model_len,
    )
