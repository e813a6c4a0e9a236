"""EngineConfig: the one configuration object of an engine process, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import InvalidRequestError

# prompts of more tokens than this are long: while requests decode, only they are paced (engine/prefill_pacer.py)
LONG_PREFILL_TOKENS = 256

# A prompt of more characters than max_model_len * this cannot fit in the context, so it is refused
# before it is tokenized (tokenizing megabytes would take seconds). Real BPE vocabularies average
# 3-5 characters per token on text; their longest tokens are runs of spaces or repeated symbols of
# up to ~128 characters (code indentation, "=====" lines), but a prompt made only of those is
# pathological. 16 leaves a wide margin over real text and still bounds the work to a few MB at 128k.
PROMPT_CHARS_PER_TOKEN = 16


class ConfigError(InvalidRequestError):
    """A flag combination the engine cannot run with."""


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None  # defaults to the model directory's name
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | npu
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory_mb: int = 512  # memory for K and V of all layers
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_mb (tests, tuning)
    enable_prefix_caching: bool = True
    # Scheduling
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 128
    # tokens per step; defaults to 2048 with chunked prefill, else max(max_model_len, 2048)
    max_num_batched_tokens: int | None = None
    # a long prompt is computed a chunk per step beside the running decodes (vLLM's flag, on by default)
    enable_chunked_prefill: bool = True
    # while requests decode, a step that also computes chunks of long prompts may take at most this
    # many times a decode-only step (engine/prefill_pacer.py); 0: chunks fill the token budget (vLLM)
    decode_stall_limit: float = 1.25
    # prompts longer than this are long (vLLM's flag): only they are paced by decode_stall_limit; 0 paces
    # every prompt (the running decodes' steps stay within the limit; new requests' first tokens come later)
    long_prefill_token_threshold: int = LONG_PREFILL_TOKENS
    # waiting *sequences* (prompts x n per request): an API request of more is refused (400), one that
    # would overflow the queue now gets 503 (engine/admission.py)
    max_waiting_requests: int = 1024
    max_n: int | None = None  # samples per prompt; defaults to (and is capped by) max_num_seqs
    # tokens one API request may ask for: its prompts x n sequences, each prompt + max_tokens; defaults to
    # max_num_seqs * max_model_len (a full batch of full contexts, what one prompt with n = --max-n may take)
    max_request_tokens: int | None = None
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    max_prompt_chars: int | None = None  # defaults to max_model_len * PROMPT_CHARS_PER_TOKEN
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    max_request_body_bytes: int = 8 * 1024 * 1024
    admin_token: str | None = None
    api_key: str | None = None  # bearer key for the inference endpoints (vLLM's --api-key); None = open
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (core process: threads.py)
    # the engine core (scheduler, model, step loop) in its own process (data_plane/engine/core); False:
    # a thread of the API process, as before
    engine_core_process: bool = True
    # CPUs of the engine-core process: auto | nobind | a list such as 1-3 (data_plane/engine/core/threads.py)
    omp_threads_bind: str = "auto"
    tensor_parallel_size: int = 1
    lora_fused_row_allreduce: bool = False  # row-parallel LoRA: one all-reduce per layer instead of two
    # Multi-LoRA
    enable_lora: bool = False
    # adapter files read and checked in a process of their own (data_plane/engine/core/adapter_reader.py);
    # False: on threads of the API process, sharing its GIL with the event loop
    adapter_reader_process: bool = True
    max_loras: int = 4  # device slots: adapters resident for compute at once
    max_lora_rank: int = 64  # slots are padded to this rank
    lora_dtype: str = "auto"  # the slots' dtype: auto (the model's) | bfloat16 | float16 (half the bytes, float sums)
    max_cpu_loras: int | None = None  # host cache of validated adapters; defaults to max(max_loras, 16)
    lora_roots: list[str] = field(default_factory=list)  # adapter paths must lie under one of these
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start
    max_adapter_labels: int = 100  # Prometheus `adapter` label values; past this they fold into "other"
    default_drain_timeout_s: float = 30.0
    # Adapters named by digest (`artifact` loads) are fetched from the control plane and cached on disk
    lora_cache_dir: str | None = None  # None: a temporary folder of this process, removed at shutdown
    lora_cache_max_bytes: int = 8 << 30
    lora_artifact_endpoint: str | None = None  # the object store's URL: presigned file URLs may lie there
    # Control plane: register there at start, heartbeat, and resolve unknown `model` names through it
    control_plane_url: str | None = None
    control_plane_token: str | None = None  # this engine's token there (its LORAPLANE_ENGINE_CREDENTIALS entry)
    engine_name: str | None = None  # the name registered there; defaults to host:port
    # seconds between heartbeats: keep it well under the control plane's LORAPLANE_ENGINE_STALE_AFTER_S
    # (30 by default), or the engine reads as unhealthy between two of them
    heartbeat_interval_s: float = 3.0
    # resolve unknown `model` names through the control plane (and load them) on demand; None: on exactly
    # when a control plane is given
    resolve_adapters: bool | None = None

    def __post_init__(self) -> None:
        if not Path(self.model, "config.json").is_file():
            raise ConfigError(f"--model {self.model!r} is not a model directory: config.json not found there")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).resolve().name
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {self.dtype!r}: expected auto, float32, bfloat16 or float16")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size {self.block_size}: expected a power of two up to 128")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if self.max_waiting_requests < 1:
            raise ConfigError("--max-waiting-requests must be at least 1")
        # one request's samples must fit in a batch and in the waiting queue, or it could never run
        n_cap = min(self.max_num_seqs, self.max_waiting_requests)
        if self.max_n is None:
            self.max_n = n_cap
        if not 1 <= self.max_n <= n_cap:
            raise ConfigError(f"--max-n must be between 1 and min(--max-num-seqs, --max-waiting-requests) = {n_cap}")
        if self.max_stop_strings < 0 or self.max_stop_string_length < 1:
            raise ConfigError("--max-stop-strings must be at least 0 and --max-stop-string-length at least 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError("--max-prompt-chars must be at least 1")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ConfigError("--max-request-tokens must be at least 1")
        if self.lora_dtype not in ("auto", "bfloat16", "float16"):
            raise ConfigError(f"--lora-dtype {self.lora_dtype!r}: expected auto, bfloat16 or float16")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 16)
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
            if self.max_cpu_loras < self.max_loras:
                raise ConfigError("--max-cpu-loras must be at least --max-loras")
            if not self.lora_roots and self.lora_modules:
                # preloaded adapters name their own directories: allow exactly those
                self.lora_roots = [str(Path(p).resolve().parent) for p in self.lora_modules.values()]
        elif self.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.lora_cache_max_bytes < 1:
            raise ConfigError("--lora-cache-max-bytes must be at least 1")
        if self.lora_artifact_endpoint is not None and not self.lora_artifact_endpoint.startswith(
                ("http://", "https://")):
            raise ConfigError(f"--lora-artifact-endpoint {self.lora_artifact_endpoint!r}: expected an http(s):// URL")
        if not 0 < self.heartbeat_interval_s <= 3600:
            raise ConfigError(f"--heartbeat-interval-s must be in (0, 3600], got {self.heartbeat_interval_s}")
        if self.control_plane_url is not None:
            if not self.control_plane_url.startswith(("http://", "https://")):
                raise ConfigError(f"--control-plane {self.control_plane_url!r}: expected an http(s):// URL")
            if not self.enable_lora:
                raise ConfigError("--control-plane needs --enable-lora (the control plane places adapters)")
            self.control_plane_url = self.control_plane_url.rstrip("/")
        if self.resolve_adapters is None:
            self.resolve_adapters = self.control_plane_url is not None
        elif self.resolve_adapters and self.control_plane_url is None:
            raise ConfigError("--resolve-adapters needs --control-plane (that is where names are resolved)")
        if self.omp_threads_bind not in ("auto", "nobind") and not re.fullmatch(
                r"\d+(-\d+)?(,\d+(-\d+)?)*", self.omp_threads_bind):
            raise ConfigError(f"--omp-threads-bind {self.omp_threads_bind!r}: expected auto, nobind or a CPU list like 1-3")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold {self.long_prefill_token_threshold}: expected 0 or more")
        if self.decode_stall_limit != 0 and self.decode_stall_limit <= 1:
            raise ConfigError(f"--decode-stall-limit {self.decode_stall_limit}: expected 0 (off) or a factor above 1, "
                              "such as 1.25")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("--num-kv-blocks must be at least 2")

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the loaded model; check the scheduling limits fit together."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        if self.max_prompt_chars is None:
            self.max_prompt_chars = self.max_model_len * PROMPT_CHARS_PER_TOKEN
        if self.max_request_tokens is None:
            self.max_request_tokens = self.max_num_seqs * self.max_model_len
        if self.enable_chunked_prefill:
            # every running sequence decodes one token per step, within the budget
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                    f"--max-num-seqs ({self.max_num_seqs})"
                )
        elif self.max_num_batched_tokens < self.max_model_len:
            # no chunked prefill: a whole prompt must fit in one step
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-model-len ({self.max_model_len}) without chunked prefill; lower --max-model-len, raise the "
                "token budget or leave --enable-chunked-prefill on"
            )
