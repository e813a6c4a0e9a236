"""RouterConfig: everything one router process is configured with, validated once.

The CLI (cli.py) builds it from flags and the environment; nothing below reads either. Secrets (the
router's token at the control plane, the engines' inference key, the client keys, the tenant keys'
pepper) come from the environment or a file named by `<VARIABLE>_FILE`, never from the command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared import secret_env
from shared.key_secrets import MIN_PEPPER_CHARS, PEPPER_ENV

ROUTER_TOKEN_ENV = "LORAPLANE_ROUTER_TOKEN"  # router → control plane (its LORAPLANE_ROUTER_TOKENS)
ENGINE_API_KEY_ENV = "LORAPLANE_ENGINE_API_KEY"  # router → engines (their --api-key)
API_KEYS_ENV = "LORAPLANE_API_KEYS"  # clients → router: static keys, comma-separated
REDIS_URL_ENV = "LORAPLANE_REDIS_URL"  # quota counters and revocations (may hold a password)
MAX_REQUEST_TOKENS_ENV = "LORAPLANE_MAX_REQUEST_TOKENS"  # --max-request-tokens' default


class RouterConfigError(ValueError):
    """A setting is missing or out of range; the message names it, never a secret's value."""


@dataclass
class RouterConfig:
    control_plane_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    router_token: str | None = None
    engine_api_key: str | None = None
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: the router is open
    refresh_interval_s: float = 1.0  # GET /v1/routes with If-None-Match this often
    demand_interval_s: float = 1.0  # POST /v1/routes/demand with the per-model queue this often
    presence_interval_s: float = 5.0  # an idle router still reports (its presence) this often
    name: str = ""  # how the control plane lists this router (cli.py: host:port when not given)
    advertise_url: str | None = None  # where clients reach it, as the console shows it (cli.py's default)
    stale_after_s: float = 5.0  # a table not revalidated for this long makes /health say degraded
    max_attempts: int = 3  # engines tried per request before the first byte (connect refused, 503)
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # between two chunks of an engine's answer
    control_plane_timeout_s: float = 5.0  # a routes revalidation, a demand report
    placement_timeout_s: float = 120.0  # a placement: the control plane pushes the adapter before answering
    max_request_body_bytes: int = 8 * 1024 * 1024  # larger bodies are answered 413 (the engine's default)
    # a request whose token reservation (usage.py: every sample of every prompt) is larger is answered 400;
    # None: no ceiling
    max_request_tokens: int | None = None
    max_connections: int = 1024  # to all engines together (httpx pool)
    prefix_chars: int = 256  # base-model prompts with equal first bytes go to the same engine
    prefix_cache_size: int = 16384  # prompt prefixes remembered (least recently used forgotten)
    affinity_slack: int = 8  # a remembered engine is skipped when it has this many more requests than the least busy
    engine_down_s: float = 2.0  # an engine that refused a connection is tried last for this long
    max_model_labels: int = 100  # distinct `model` metric labels before "other" (and `tenant` labels)
    # tenants (issue 14): with require_api_key every client sends a static key (LORAPLANE_API_KEYS) or a
    # tenant key (lp_…, checked with the control plane), and tenant keys' quotas are counted in Redis
    require_api_key: bool = False
    redis_url: str | None = field(default=None, repr=False)  # LORAPLANE_REDIS_URL (may hold a password)
    redis_prefix: str = "loraplane:"  # of every Redis key and channel: one per fleet sharing a Redis
    quota_failure: str = "closed"  # Redis unreachable: closed (503) or open (admit, uncounted)
    key_cache_ttl_s: float = 5.0  # a verified key is checked again after this long: revocation's worst case
    # LORAPLANE_KEY_PEPPER: the control plane's, to verify tenant keys' HMAC hashes (None: legacy hashes only)
    key_pepper: str | None = field(default=None, repr=False)
    # failed tenant-key attempts (shared/key_checks.py): past these within the window, 429 without a hash
    key_failures_per_address: int = 20
    key_failures_per_key: int = 100  # of one key id, from any addresses; its verified secret still passes
    key_failure_window_s: float = 60.0
    concurrency_lease_s: float = 900.0  # a concurrent-request slot a crashed router held frees itself after this
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        url = urlsplit(self.control_plane_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise RouterConfigError(f"--control-plane must be an http(s) URL, got {self.control_plane_url!r}")
        self.control_plane_url = self.control_plane_url.rstrip("/")
        if not 0 <= self.port < 65536:
            raise RouterConfigError(f"--port must be in 0..65535, got {self.port}")
        self.api_keys = frozenset(self.api_keys)
        for what, token in (("the router token", self.router_token), ("the engine API key", self.engine_api_key),
                            *(("a client API key", k) for k in self.api_keys)):
            if token is not None and (not token or any(c.isspace() for c in token)):
                raise RouterConfigError(f"{what} is empty or contains whitespace")
        positive = {"refresh_interval_s": self.refresh_interval_s, "demand_interval_s": self.demand_interval_s,
                    "presence_interval_s": self.presence_interval_s,
                    "stale_after_s": self.stale_after_s, "connect_timeout_s": self.connect_timeout_s,
                    "read_timeout_s": self.read_timeout_s, "control_plane_timeout_s": self.control_plane_timeout_s,
                    "placement_timeout_s": self.placement_timeout_s,
                    "engine_down_s": self.engine_down_s, "key_failure_window_s": self.key_failure_window_s}
        for name, value in positive.items():
            if not value > 0:
                raise RouterConfigError(f"{name} must be positive, got {value}")
        counts = {"max_attempts": self.max_attempts, "max_request_body_bytes": self.max_request_body_bytes,
                  "max_connections": self.max_connections, "prefix_chars": self.prefix_chars,
                  "prefix_cache_size": self.prefix_cache_size, "max_model_labels": self.max_model_labels,
                  "key_failures_per_address": self.key_failures_per_address,
                  "key_failures_per_key": self.key_failures_per_key}
        for name, value in counts.items():
            if value < 1:
                raise RouterConfigError(f"{name} must be at least 1, got {value}")
        if self.quota_failure not in ("closed", "open"):
            raise RouterConfigError(f"--quota-failure must be closed or open, got {self.quota_failure!r}")
        if not (self.key_cache_ttl_s > 0 and self.concurrency_lease_s > 0):
            raise RouterConfigError("key_cache_ttl_s and concurrency_lease_s must be positive")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise RouterConfigError(f"--max-request-tokens must be at least 1, got {self.max_request_tokens}")
        if self.key_pepper is not None and len(self.key_pepper) < MIN_PEPPER_CHARS:
            raise RouterConfigError(f"{PEPPER_ENV} must be at least {MIN_PEPPER_CHARS} characters")
        if self.affinity_slack < 0:
            raise RouterConfigError(f"affinity_slack must not be negative, got {self.affinity_slack}")


def read_secret(env: Mapping[str, str], name: str) -> str | None:
    """$NAME, else the contents of the file $NAME_FILE (stripped), else None."""
    try:
        return secret_env.read_secret(env, name)
    except ValueError as exc:
        raise RouterConfigError(str(exc)) from None


def secrets_from_env(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The RouterConfig fields that hold secrets, from the environment (or their files)."""
    env = os.environ if env is None else env
    keys = read_secret(env, API_KEYS_ENV)
    return {
        "router_token": read_secret(env, ROUTER_TOKEN_ENV),
        "engine_api_key": read_secret(env, ENGINE_API_KEY_ENV),
        "api_keys": frozenset(k.strip() for k in (keys or "").split(",") if k.strip()),
        "redis_url": read_secret(env, REDIS_URL_ENV),
        "key_pepper": read_secret(env, PEPPER_ENV),
    }
