"""RouterConfig: everything one router process is configured with, validated once.

The CLI (cli.py) builds it from flags and the environment, with a parser generated from the fields (each
carries its flag, variable, default and help: shared/settings.py); nothing below reads either. Secrets (the
router's token at the control plane, the engines' inference key, the client keys, the tenant keys'
pepper) come from the environment or a file named by `<VARIABLE>_FILE`, never from the command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from shared.key_secrets import MIN_PEPPER_CHARS, PEPPER_ENV
from shared.settings import (
    SettingError,
    check_choices,
    host_setting,
    log_format_setting,
    log_level_setting,
    port_setting,
    secrets_from,
    setting,
    settings_repr,
)

TIMEOUTS, TENANTS = "timeouts and retries", "tenants and quotas"


class RouterConfigError(ValueError):
    """A setting is missing or out of range; the message names it, never a secret's value."""


@dataclass
class RouterConfig:
    """The router's settings; `loraplane router --help` is generated from these fields (shared/settings.py)."""

    control_plane_url: str = setting(flag="--control-plane", required=True, metavar="URL",
                                     help="the control plane's base URL, where the routing table comes from")
    host: str = host_setting()
    port: int = port_setting(8000)
    # secrets: from the environment or a file, never from a flag
    router_token: str | None = setting(None, env="LORAPLANE_ROUTER_TOKEN", secret=True,
                                       help="this router's token at the control plane (one of its "
                                       "LORAPLANE_ROUTER_TOKENS)")
    engine_api_key: str | None = setting(None, env="LORAPLANE_ENGINE_API_KEY", secret=True,
                                         help="the key the router sends to the engines (their --api-key)")
    api_keys: frozenset[str] = setting(default_factory=frozenset, env="LORAPLANE_API_KEYS", secret=True,
                                       help="static keys clients must send, comma-separated; unset, the router is "
                                       "open (unless --require-api-key)")
    refresh_interval_s: float = setting(1.0, flag="--refresh-interval-s", group=TIMEOUTS,
                                        help="how often the routing table is revalidated (If-None-Match)")
    demand_interval_s: float = setting(1.0, flag="--demand-interval-s", group=TIMEOUTS,
                                       help="how often per-model queue figures are reported to the control plane")
    presence_interval_s: float = setting(5.0, help="an idle router still reports (its presence) this often")
    name: str = setting("", flag="--router-name", metavar="NAME",
                        help="how the control plane lists this router (default: host:port)")
    advertise_url: str | None = setting(None, flag="--advertise-url", metavar="URL",
                                        help="where clients reach this router, as the console shows it "
                                        "(default: http://HOST:PORT)")
    stale_after_s: float = setting(5.0, flag="--stale-after-s", group=TIMEOUTS,
                                   help="/health says degraded once the table has not been confirmed for this long")
    max_attempts: int = setting(3, flag="--max-attempts", group=TIMEOUTS,
                                help="engines tried per request before the first byte (connect refused, 503)")
    connect_timeout_s: float = setting(2.0, flag="--connect-timeout-s", group=TIMEOUTS,
                                       help="longest wait for a connection to an engine")
    read_timeout_s: float = setting(600.0, flag="--read-timeout-s", group=TIMEOUTS,
                                    help="longest wait for an engine's next bytes (between two chunks of its answer)")
    control_plane_timeout_s: float = setting(5.0, help="a routes revalidation, a demand report")
    placement_timeout_s: float = setting(120.0, help="a placement: the control plane pushes the adapter before "
                                         "answering")
    max_request_body_bytes: int = setting(8 * 1024 * 1024, flag="--max-request-body-bytes", group="HTTP",
                                          default_text="8 MiB",
                                          help="larger request bodies are answered 413 (the engine's default)")
    max_request_tokens: int | None = setting(
        None, flag="--max-request-tokens", env="LORAPLANE_MAX_REQUEST_TOKENS", group="HTTP", metavar="TOKENS",
        help="the most tokens one request may reserve (its prompts, plus max_tokens for each sample of each "
        "prompt, or the context left without max_tokens); larger ones are answered 400 (default: no ceiling)")
    max_connections: int = setting(1024, help="connections to all engines together (the httpx pool)")
    prefix_chars: int = setting(256, help="base-model prompts with equal first characters go to the same engine")
    prefix_cache_size: int = setting(16384, help="prompt prefixes remembered (least recently used forgotten)")
    affinity_slack: int = setting(8, help="a remembered engine is skipped when it has this many more requests "
                                  "than the least busy")
    engine_down_s: float = setting(2.0, help="an engine that refused a connection is tried last for this long")
    max_model_labels: int = setting(100, help="distinct `model` metric labels before 'other' (and `tenant` labels)")
    require_api_key: bool = setting(
        False, flag="--require-api-key", group=TENANTS,
        help="every client sends a key: a static one (LORAPLANE_API_KEYS) or a tenant key (lp_…), whose adapters "
        "and quotas the control plane keeps (quotas counted in Redis: LORAPLANE_REDIS_URL)")
    redis_url: str | None = setting(None, env="LORAPLANE_REDIS_URL", secret=True,
                                    help="Redis, where tenant keys' quotas are counted and their revocations "
                                    "arrive (with --require-api-key; the URL may hold a password)")
    redis_prefix: str = setting("loraplane:", flag="--redis-prefix", group=TENANTS,
                                help="of every Redis key and channel (the control plane's LORAPLANE_REDIS_PREFIX): "
                                "one per fleet sharing a Redis")
    quota_failure: str = setting("closed", flag="--quota-failure", group=TENANTS, choices=("closed", "open"),
                                 help="Redis unreachable: refuse requests with quotas (503) or admit them uncounted")
    key_cache_ttl_s: float = setting(5.0, flag="--key-cache-ttl-s", group=TENANTS,
                                     help="a verified tenant key is checked with the control plane again after "
                                     "this long (the bound on a revocation Redis did not carry)")
    key_pepper: str | None = setting(None, env=PEPPER_ENV, secret=True,
                                     help="the control plane's pepper, to verify tenant keys' HMAC hashes; unset, "
                                     "only keys hashed before the pepper existed are verified")
    key_failures_per_address: int = setting(
        20, flag="--key-failures-per-address", group=TENANTS,
        help="failed tenant-key attempts from one client address within --key-failure-window-s, after which its "
        "attempts are answered 429 without a hash (shared/key_checks.py)")
    key_failures_per_key: int = setting(
        100, flag="--key-failures-per-key", group=TENANTS,
        help="failed attempts of one key id (from any addresses) after which its offers are answered 429, but for "
        "the secret already verified (its holder keeps working)")
    key_failure_window_s: float = setting(60.0, flag="--key-failure-window-s", group=TENANTS,
                                          help="the window over which failed tenant-key attempts are counted")
    concurrency_lease_s: float = setting(900.0, help="a concurrent-request slot a crashed router held frees itself "
                                         "after this long")
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()

    __repr__ = settings_repr  # the secrets hidden

    def __post_init__(self) -> None:
        check_choices(self, RouterConfigError)
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
        if not (self.key_cache_ttl_s > 0 and self.concurrency_lease_s > 0):
            raise RouterConfigError("key_cache_ttl_s and concurrency_lease_s must be positive")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise RouterConfigError(f"--max-request-tokens must be at least 1, got {self.max_request_tokens}")
        if self.key_pepper is not None and len(self.key_pepper) < MIN_PEPPER_CHARS:
            raise RouterConfigError(f"{PEPPER_ENV} must be at least {MIN_PEPPER_CHARS} characters")
        if self.affinity_slack < 0:
            raise RouterConfigError(f"affinity_slack must not be negative, got {self.affinity_slack}")


def secrets_from_env(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The RouterConfig fields that hold secrets, from the environment (or their files), None (or no keys)
    where unset."""
    try:
        return secrets_from(RouterConfig, os.environ if env is None else env)
    except SettingError as exc:
        raise RouterConfigError(str(exc)) from None
