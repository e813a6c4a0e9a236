"""AgentConfig: everything one `loraplane agent` process is configured with, validated once.

The CLI (cli.py) builds it from flags and the environment with a parser generated from the fields
(shared/settings.py). Secrets come from the environment or the file `<VARIABLE>_FILE` names, never from
the command line, as the engines read theirs: the agent's admin token (what the control plane sends it,
`loraplane engines token NAME`), its token at the control plane, and the key it sends to the engine.
`--engine-url` must pass the engine-URL rules of registration (shared.engine_urls); the CLI checks it,
since a host name is resolved for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from shared.settings import (
    check_choices,
    host_setting,
    log_format_setting,
    log_level_setting,
    port_setting,
    setting,
    settings_repr,
)

ENGINE, CONTROL, ADAPTERS = "engine", "control plane", "adapters"
KINDS = ("vllm",)  # each kind ships with a test against the real server


class AgentConfigError(ValueError):
    """A setting is missing or out of range; the message names it, never a secret's value."""


@dataclass
class AgentConfig:
    """`loraplane agent --help` is generated from these fields (shared/settings.py)."""

    engine_url: str = setting(flag="--engine-url", required=True, metavar="URL", group=ENGINE,
                              help="the engine's OpenAI server, e.g. http://127.0.0.1:8000: the agent drives its "
                              "LoRA API, and routers send inference there (it is registered as the inference URL)")
    control_plane_url: str = setting(flag="--control-plane", required=True, metavar="URL", group=CONTROL,
                                     help="the control plane to register with and fetch adapter versions from")
    adapter_dir: str = setting(flag="--adapter-dir", required=True, metavar="DIR", group=ADAPTERS,
                               help="where adapter versions are fetched by digest (DIR/<digest>/), a folder the "
                               "engine reads too (a shared volume); the engine is given no path outside it")
    engine_kind: str = setting("vllm", flag="--engine-kind", choices=KINDS, group=ENGINE,
                               help="which engine runs beside the agent")
    engine_name: str | None = setting(None, flag="--engine-name", group=CONTROL,
                                      help="the name to register under (default: host:port of the agent)")
    max_loras: int | None = setting(None, flag="--max-loras", group=ENGINE,
                                    help="the engine's --max-loras, reported when the engine does not say it "
                                    "(vLLM says it in its /metrics once it has served a request)")
    max_lora_rank: int | None = setting(None, flag="--max-lora-rank", group=ENGINE,
                                        help="the engine's --max-lora-rank, reported to the control plane (vLLM "
                                        "does not expose it)")
    engine_timeout_s: float = setting(60.0, flag="--engine-timeout-s", group=ENGINE,
                                      help="the longest one call to the engine may take (a load included)")
    host: str = host_setting()
    port: int = port_setting(8001, what="of the agent's admin API (what the control plane calls)")
    lora_cache_max_bytes: int = setting(
        8 << 30, flag="--lora-cache-max-bytes", group=ADAPTERS, metavar="N", default_text="8 GiB",
        help="bytes of fetched adapters kept in --adapter-dir; least recently used ones the engine does not "
        "serve are evicted")
    lora_artifact_endpoint: str | None = setting(
        None, flag="--lora-artifact-endpoint", env="LORAPLANE_ARTIFACT_ENDPOINT", group=ADAPTERS, metavar="URL",
        help="the artifact store's endpoint (e.g. S3): presigned file URLs are fetched from this origin too, "
        "besides the control plane's")
    heartbeat_interval_s: float = setting(
        3.0, flag="--heartbeat-interval-s", group=CONTROL,
        help="seconds between heartbeats; keep it well under the control plane's LORAPLANE_ENGINE_STALE_AFTER_S")
    watch_interval_s: float = setting(1.0, flag="--watch-interval-s", group=ENGINE,
                                      help="how often the engine's /health and start time are read (a change is "
                                      "reported at once)")
    # secrets: from the environment or a file, never from a flag
    admin_token: str | None = setting(None, env="LORAPLANE_ADMIN_TOKEN", secret=True,
                                      help="bearer token of the agent's admin API: this engine's own token "
                                      "(`loraplane engines token NAME`); unset, the admin API is open")
    control_plane_token: str | None = setting(None, env="LORAPLANE_CONTROL_PLANE_TOKEN", secret=True,
                                              help="this engine's token at the control plane (its "
                                              "LORAPLANE_ENGINE_CREDENTIALS entry)")
    engine_api_key: str | None = setting(None, env="LORAPLANE_ENGINE_API_KEY", secret=True,
                                         help="the key the agent sends to the engine (its --api-key), as routers do")
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()

    __repr__ = settings_repr  # the secrets hidden

    def __post_init__(self) -> None:
        check_choices(self, AgentConfigError)
        for flag, url in (("--control-plane", self.control_plane_url),
                          ("--lora-artifact-endpoint", self.lora_artifact_endpoint)):
            if url is not None and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc):
                raise AgentConfigError(f"{flag} must be an http(s) URL, got {url!r}")
        self.control_plane_url = self.control_plane_url.rstrip("/")
        self.adapter_dir = str(Path(self.adapter_dir).expanduser().resolve())
        if not 0 <= self.port < 65536:
            raise AgentConfigError(f"--port must be in 0..65535, got {self.port}")
        for flag, count in (("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank)):
            if count is not None and count < 1:
                raise AgentConfigError(f"{flag} must be at least 1, got {count}")
        if self.lora_cache_max_bytes < 1:
            raise AgentConfigError("--lora-cache-max-bytes must be at least 1")
        for flag, seconds in (("--engine-timeout-s", self.engine_timeout_s),
                              ("--heartbeat-interval-s", self.heartbeat_interval_s),
                              ("--watch-interval-s", self.watch_interval_s)):
            if not 0 < seconds <= 3600:
                raise AgentConfigError(f"{flag} must be in (0, 3600], got {seconds}")
        for what, token in (("LORAPLANE_ADMIN_TOKEN", self.admin_token),
                            ("LORAPLANE_CONTROL_PLANE_TOKEN", self.control_plane_token),
                            ("LORAPLANE_ENGINE_API_KEY", self.engine_api_key)):
            if token is not None and (not token or any(c.isspace() for c in token)):
                raise AgentConfigError(f"{what} is empty or contains whitespace")
