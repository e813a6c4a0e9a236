"""ControlPlaneSettings: the one config object of the control-plane process, validated on construction.

Flags and `LORAPLANE_*` environment variables are read only in `from_env_and_args` (the edge); everything
else receives a finished ControlPlaneSettings. Tokens and database passwords never appear in repr(),
logs or error messages: repr shows how many tokens there are and the URL with its password masked.
"""

from __future__ import annotations

import ipaddress
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from shared.key_secrets import MIN_PEPPER_CHARS, PEPPER_ENV
from shared.logging_setup import LOG_FORMATS, LOG_LEVELS
from shared.names import name_problem
from shared.secret_env import read_secret

ENV_PREFIX = "LORAPLANE_"
# Plain driver names are accepted for convenience and mapped to the async drivers the service runs on.
_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}
_SUPPORTED = ("sqlite+aiosqlite", "postgresql+asyncpg")
ARTIFACT_SCHEMES = ("file", "s3", "gs", "az")


def default_database_url() -> str:
    return f"sqlite+aiosqlite:///{Path.cwd() / '.loraplane' / 'control.db'}"


def default_artifact_store(database_url: str) -> str:
    """Beside an SQLite file (the embedded default keeps everything in one folder), else under .loraplane/."""
    parsed = make_url(database_url)
    if parsed.drivername.startswith("sqlite") and parsed.database and parsed.database != ":memory:":
        return (Path(parsed.database).resolve().parent / "artifacts").as_uri()
    return (Path.cwd() / ".loraplane" / "artifacts").as_uri()


@dataclass
class ControlPlaneSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str = field(default_factory=default_database_url)
    admin_tokens: tuple[str, ...] = ()
    read_tokens: tuple[str, ...] = ()
    # Directories adapter paths must lie in; a load naming anything else is refused before files are read.
    # --lora-roots / LORAPLANE_LORA_ROOTS, as the engine spells it (--adapter-root is the old name).
    adapter_roots: tuple[str, ...] = ()
    reconcile_interval_s: float = 30.0
    engine_timeout_s: float = 10.0
    # A load that makes the engine fetch the version from the artifact store may take engine_timeout_s
    # plus the version's size at this rate (MB/s; LORAPLANE_ENGINE_FETCH_MIN_MBPS): a stopped engine still
    # costs a bounded wait, a large adapter the time its bytes need.
    engine_fetch_min_mbps: float = 25.0
    # An engine whose last heartbeat is older than this reads as unhealthy (and gets no new placements).
    engine_stale_after_s: float = 30.0
    # Bearer token of the engines' admin endpoints (their --admin-token); sent on pushes, never logged.
    # LORAPLANE_ENGINE_ADMIN_TOKEN (LORAPLANE_ENGINE_TOKEN is its old name, still read).
    engine_token: str | None = None
    # engine name -> the token that engine sends (its LORAPLANE_CONTROL_PLANE_TOKEN): it may register,
    # heartbeat, resolve and drain as that name and nothing else (LORAPLANE_ENGINE_CREDENTIALS).
    engine_credentials: Mapping[str, str] = field(default_factory=dict)
    # When set, engine URLs must point into one of these networks (CIDR; LORAPLANE_ENGINE_ALLOWED_NETWORKS);
    # unset, any address but link-local and cloud-metadata ones is accepted.
    engine_allowed_networks: tuple[str, ...] = ()
    # Apply Alembic migrations when the app starts (the CLI's `db` commands set this off).
    migrate_on_start: bool = True
    # Where every version's bytes live (control_plane/artifacts/store.py): file:///path or s3://bucket/prefix
    # (AWS_* variables for credentials, region, endpoint). --artifact-store / LORAPLANE_ARTIFACT_STORE.
    # Default: an `artifacts` folder beside the SQLite file, or .loraplane/artifacts/ with PostgreSQL.
    artifact_store: str | None = None
    # The largest version (all its files) a load or upload may bring in (413 above it).
    max_artifact_bytes: int = 4 << 30
    # How engines reach this control plane, when artifact refs should be absolute (LORAPLANE_PUBLIC_URL);
    # unset, refs are paths that each engine resolves against its own --control-plane URL.
    public_url: str | None = None
    # Tokens of routers (LORAPLANE_ROUTER_TOKENS): they may read routes, report demand and ask for
    # placements, nothing else.
    router_tokens: tuple[str, ...] = ()
    # replicas {min, max} of an adapter that sets none (--default-min-replicas, --default-max-replicas;
    # max 0 means "all" matching engines, "all" on the command line)
    default_min_replicas: int = 1
    default_max_replicas: int = 3
    # demand scaling (control_plane/domain/placements): a replica more when waiting+running per replica
    # stays above scale_up_load_per_replica for scale_window_s; one less after scale_down_idle_s idle;
    # at most one change per adapter per window
    scale_up_load_per_replica: float = 8.0
    scale_window_s: float = 30.0
    scale_down_idle_s: float = 300.0
    # how many placements one reconcile interval may move to rebalance onto returning or new engines
    rebalance_max_moves: int = 4
    # engines reconciled at once: each round holds a database connection while it calls its engine, and
    # 200 at once took the whole pool, so heartbeats waited past the stale-after and healthy engines went stale
    reconcile_concurrency: int = 8
    # loads and unloads one round sends its engine at once: a pass that places 100,000 adapters loads
    # 500 on each of 200 engines, which one at a time took longer than a round may
    reconcile_engine_calls: int = 8
    # Signs the web console's session cookies (LORAPLANE_UI_SESSION_SECRET); replicas must share it. Unset, the
    # console draws a random one per process: sessions then survive no restart and span no replicas.
    ui_session_secret: str | None = None
    # Redis (LORAPLANE_REDIS_URL), where key revocations and tenants' new quotas are published to the
    # routers at once; unset, routers see them within their key cache TTL. LORAPLANE_REDIS_PREFIX: the
    # routers' --redis-prefix (one per fleet sharing a Redis).
    redis_url: str | None = None
    redis_prefix: str = "loraplane:"
    # Tenant keys' hashes are HMAC-SHA256 under this pepper (LORAPLANE_KEY_PEPPER or LORAPLANE_KEY_PEPPER_FILE;
    # every router needs the same). Unset, no key can be made (503) and only legacy argon2 hashes verify.
    key_pepper: str | None = None
    # failed tenant-key attempts (shared/key_checks.py): past these within the window, 429 without a hash
    # (LORAPLANE_KEY_FAILURES_PER_ADDRESS, LORAPLANE_KEY_FAILURES_PER_KEY, LORAPLANE_KEY_FAILURE_WINDOW_S)
    key_failures_per_address: int = 20
    key_failures_per_key: int = 100
    key_failure_window_s: float = 60.0
    log_level: str = "info"
    log_format: str = "text"  # text | json (shared/logging_setup.py)

    def __post_init__(self) -> None:
        self.admin_tokens = tuple(self.admin_tokens)
        self.read_tokens = tuple(self.read_tokens)
        self.router_tokens = tuple(self.router_tokens)
        self.adapter_roots = tuple(str(Path(r).expanduser().resolve()) for r in self.adapter_roots)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for kind, tokens in (("admin", self.admin_tokens), ("read", self.read_tokens), ("router", self.router_tokens)):
            # A message about a bad token names its position, never its value.
            for i, token in enumerate(tokens):
                if not token or token != token.strip() or any(c.isspace() for c in token):
                    raise ValueError(f"{kind} token #{i + 1} is empty or contains whitespace")
        kinds = (set(self.admin_tokens), set(self.read_tokens), set(self.router_tokens))
        if sum(len(k) for k in kinds) != len(set().union(*kinds)):
            raise ValueError("a token is listed under two kinds (admin, read, router); give each token one kind")
        self.engine_credentials = dict(self.engine_credentials)
        for name, token in self.engine_credentials.items():
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"engine credentials: {problem} (engine {name[:40]!r})")
            if not token or any(c.isspace() for c in token):
                raise ValueError(f"engine credentials: the token of engine {name!r} is empty or contains whitespace")
        engine_tokens = list(self.engine_credentials.values())
        if len(set(engine_tokens)) != len(engine_tokens):
            raise ValueError("engine credentials: two engines share a token; give each engine its own")
        if set(engine_tokens) & (set(self.admin_tokens) | set(self.read_tokens) | set(self.router_tokens)):
            raise ValueError("engine credentials: an engine's token is also an admin, read or router token")
        try:
            self.engine_allowed_networks = tuple(str(ipaddress.ip_network(n.strip(), strict=False))
                                                 for n in self.engine_allowed_networks)
        except ValueError as exc:
            raise ValueError(f"engine_allowed_networks: {exc}") from None
        if min(self.reconcile_interval_s, self.engine_timeout_s, self.engine_stale_after_s,
               self.engine_fetch_min_mbps) <= 0:
            raise ValueError("reconcile_interval_s, engine_timeout_s, engine_fetch_min_mbps and "
                             "engine_stale_after_s must be positive")
        if self.engine_token is not None and (not self.engine_token or any(c.isspace() for c in self.engine_token)):
            raise ValueError("the engine token is empty or contains whitespace")
        if self.default_min_replicas < 0 or self.default_max_replicas < 0:
            raise ValueError("default_min_replicas and default_max_replicas must be >= 0 (max 0 means all)")
        if 0 < self.default_max_replicas < self.default_min_replicas:
            raise ValueError("default_max_replicas is below default_min_replicas")
        if min(self.scale_up_load_per_replica, self.scale_window_s, self.scale_down_idle_s) <= 0:
            raise ValueError("scale_up_load_per_replica, scale_window_s and scale_down_idle_s must be positive")
        if self.rebalance_max_moves < 0:
            raise ValueError("rebalance_max_moves must be >= 0")
        if self.reconcile_concurrency < 1:
            raise ValueError("reconcile_concurrency must be >= 1")
        if self.reconcile_engine_calls < 1:
            raise ValueError("reconcile_engine_calls must be >= 1")
        self.database_url = normalize_database_url(self.database_url)
        if self.artifact_store is None:
            self.artifact_store = default_artifact_store(self.database_url)
        if self.artifact_store.split("://", 1)[0] not in ARTIFACT_SCHEMES or "://" not in self.artifact_store:
            raise ValueError(f"artifact_store must be a URL with one of the schemes {', '.join(ARTIFACT_SCHEMES)}")
        if self.max_artifact_bytes <= 0:
            raise ValueError("max_artifact_bytes must be positive")
        if self.public_url is not None:
            self.public_url = self.public_url.rstrip("/")
            if not self.public_url.startswith(("http://", "https://")):
                raise ValueError("public_url must be an http(s) URL")
        if self.key_pepper is not None and len(self.key_pepper) < MIN_PEPPER_CHARS:
            raise ValueError(f"{PEPPER_ENV} must be at least {MIN_PEPPER_CHARS} characters")
        if min(self.key_failures_per_address, self.key_failures_per_key) < 1 or not self.key_failure_window_s > 0:
            raise ValueError("key_failures_per_address and key_failures_per_key must be >= 1, key_failure_window_s "
                             "positive")
        if self.ui_session_secret is not None and len(self.ui_session_secret) < 16:
            raise ValueError("ui_session_secret must be at least 16 characters")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"unknown log level {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"unknown log format {self.log_format!r}; expected text or json")

    def __repr__(self) -> str:
        return (
            f"ControlPlaneSettings(host={self.host!r}, port={self.port}, "
            f"database_url={self.safe_database_url!r}, admin_tokens=<{len(self.admin_tokens)} hidden>, "
            f"read_tokens=<{len(self.read_tokens)} hidden>, router_tokens=<{len(self.router_tokens)} hidden>, "
            f"default_replicas={self.default_min_replicas}..{self.default_max_replicas or 'all'}, "
            f"scale_up_load_per_replica={self.scale_up_load_per_replica}, scale_window_s={self.scale_window_s}, "
            f"scale_down_idle_s={self.scale_down_idle_s}, rebalance_max_moves={self.rebalance_max_moves}, "
            f"reconcile_concurrency={self.reconcile_concurrency}, "
            f"reconcile_engine_calls={self.reconcile_engine_calls}, "
            f"adapter_roots={self.adapter_roots!r}, "
            f"reconcile_interval_s={self.reconcile_interval_s}, engine_timeout_s={self.engine_timeout_s}, "
            f"engine_fetch_min_mbps={self.engine_fetch_min_mbps}, "
            f"engine_stale_after_s={self.engine_stale_after_s}, "
            f"engine_token={'<hidden>' if self.engine_token else None}, "
            f"engine_credentials=<{len(self.engine_credentials)} engines: {sorted(self.engine_credentials)}>, "
            f"engine_allowed_networks={self.engine_allowed_networks!r}, "
            f"migrate_on_start={self.migrate_on_start}, artifact_store={str(self.artifact_store).split('?')[0]!r}, "
            f"max_artifact_bytes={self.max_artifact_bytes}, public_url={self.public_url!r}, "
            f"ui_session_secret={'<hidden>' if self.ui_session_secret else None}, "
            f"key_pepper={'<hidden>' if self.key_pepper else None}, "
            f"key_failures={self.key_failures_per_address}/address,{self.key_failures_per_key}/key id "
            f"per {self.key_failure_window_s}s, "
            f"redis_url={'<set>' if self.redis_url else None}, redis_prefix={self.redis_prefix!r}, log_level={self.log_level!r}, log_format={self.log_format!r})"
        )

    __str__ = __repr__

    def load_deadline_s(self, size_bytes: int) -> float:
        """How long a load that fetches `size_bytes` from the artifact store may take."""
        return self.engine_timeout_s + size_bytes / (self.engine_fetch_min_mbps * 1e6)

    @property
    def safe_database_url(self) -> str:
        return make_url(self.database_url).render_as_string(hide_password=True)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ControlPlaneSettings:
        """Settings from `LORAPLANE_*` variables; `overrides` (from flags, not None) take precedence."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        scalars = {"HOST": ("host", str), "PORT": ("port", int), "DATABASE_URL": ("database_url", str),
                   "RECONCILE_INTERVAL_S": ("reconcile_interval_s", float),
                   "ENGINE_TIMEOUT_S": ("engine_timeout_s", float), "LOG_LEVEL": ("log_level", str),
                   "ENGINE_FETCH_MIN_MBPS": ("engine_fetch_min_mbps", float),
                   "LOG_FORMAT": ("log_format", str), "ARTIFACT_STORE": ("artifact_store", str),
                   "MAX_ARTIFACT_BYTES": ("max_artifact_bytes", int), "PUBLIC_URL": ("public_url", str),
                   "ENGINE_STALE_AFTER_S": ("engine_stale_after_s", float), "ENGINE_TOKEN": ("engine_token", str),
                   "DEFAULT_MIN_REPLICAS": ("default_min_replicas", int),
                   "DEFAULT_MAX_REPLICAS": ("default_max_replicas", parse_max_replicas),
                   "SCALE_UP_LOAD_PER_REPLICA": ("scale_up_load_per_replica", float),
                   "SCALE_WINDOW_S": ("scale_window_s", float), "SCALE_DOWN_IDLE_S": ("scale_down_idle_s", float),
                   "REBALANCE_MAX_MOVES": ("rebalance_max_moves", int),
                   "RECONCILE_CONCURRENCY": ("reconcile_concurrency", int),
                   "RECONCILE_ENGINE_CALLS": ("reconcile_engine_calls", int),
                   "UI_SESSION_SECRET": ("ui_session_secret", str),
                   "REDIS_URL": ("redis_url", str), "REDIS_PREFIX": ("redis_prefix", str),
                   "KEY_FAILURES_PER_ADDRESS": ("key_failures_per_address", int),
                   "KEY_FAILURES_PER_KEY": ("key_failures_per_key", int),
                   "KEY_FAILURE_WINDOW_S": ("key_failure_window_s", float),
                   "ENGINE_ADMIN_TOKEN": ("engine_token", str)}  # the new name after the old: it wins
        for suffix, (name, convert) in scalars.items():
            raw = env.get(ENV_PREFIX + suffix)
            if raw:
                try:
                    values[name] = convert(raw)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX}{suffix} must be a {convert.__name__}") from None
        # Token lists are comma-separated; adapter roots use the OS path separator or commas.
        for suffix, name in (("ADMIN_TOKENS", "admin_tokens"), ("READ_TOKENS", "read_tokens"),
                             ("ROUTER_TOKENS", "router_tokens")):
            if env.get(ENV_PREFIX + suffix):
                values[name] = tuple(t for t in env[ENV_PREFIX + suffix].split(",") if t)
        pepper = read_secret(env, PEPPER_ENV)
        if pepper is not None:
            values["key_pepper"] = pepper
        if env.get(ENV_PREFIX + "ENGINE_CREDENTIALS"):
            values["engine_credentials"] = parse_engine_credentials(env[ENV_PREFIX + "ENGINE_CREDENTIALS"])
        if env.get(ENV_PREFIX + "ENGINE_ALLOWED_NETWORKS"):
            raw = env[ENV_PREFIX + "ENGINE_ALLOWED_NETWORKS"]
            values["engine_allowed_networks"] = tuple(n for n in raw.split(",") if n.strip())
        roots_var = ENV_PREFIX + "LORA_ROOTS"
        if not env.get(roots_var) and env.get(ENV_PREFIX + "ADAPTER_ROOTS"):
            roots_var = ENV_PREFIX + "ADAPTER_ROOTS"
            warnings.warn(f"{roots_var} is deprecated; set {ENV_PREFIX}LORA_ROOTS (the same value)",
                          FutureWarning, stacklevel=2)
        if env.get(roots_var):
            raw = env[roots_var].replace(os.pathsep, ",")
            values["adapter_roots"] = tuple(r for r in raw.split(",") if r)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def parse_max_replicas(raw: str) -> int:
    """A replica maximum: a count, or `all` (stored as 0)."""
    return 0 if raw.strip().lower() == "all" else int(raw)


parse_max_replicas.__name__ = "count or 'all'"  # named in the error message of a bad variable


def parse_engine_credentials(raw: str) -> dict[str, str]:
    """`name=token,name=token` (names hold no `=` or `,`; a token may contain `=`). Messages name the
    entry's position, never a token."""
    out: dict[str, str] = {}
    for i, item in enumerate((x.strip() for x in raw.split(",")), 1):
        if not item:
            continue
        name, sep, token = item.partition("=")
        if not sep or not name or not token:
            raise ValueError(f"{ENV_PREFIX}ENGINE_CREDENTIALS entry #{i} is not name=token")
        if name in out:
            raise ValueError(f"{ENV_PREFIX}ENGINE_CREDENTIALS names engine {name!r} twice")
        out[name] = token
    return out


def normalize_database_url(url: str) -> str:
    """Map plain `sqlite://` / `postgresql://` to the async drivers; refuse other databases."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError("database_url is not a valid SQLAlchemy URL") from None
    driver = _ASYNC_DRIVERS.get(parsed.drivername, parsed.drivername)
    if driver not in _SUPPORTED:
        raise ValueError(f"database_url must use one of {', '.join(_SUPPORTED)}, got {parsed.drivername!r}")
    return parsed.set(drivername=driver).render_as_string(hide_password=False)
