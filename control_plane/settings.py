"""ControlPlaneSettings: the one config object of the control-plane process, validated on construction.

Each field carries its flag, `LORAPLANE_*` variable, default and help (shared/settings.py). They are read only
at the edge, by `loraplane control`'s generated parser (cli.py) or `from_env`; everything else receives a
finished ControlPlaneSettings. Tokens and database passwords never appear in repr(),
logs or error messages: repr shows how many tokens there are and the URL with its password masked.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from control_plane.engine_tokens import ENGINE_SECRET_ENV, ENGINE_SECRET_OLD_ENV
from shared.key_secrets import MIN_PEPPER_CHARS, PEPPER_ENV
from shared.names import name_problem
from shared.settings import (
    Alias,
    check_choices,
    host_setting,
    log_format_setting,
    log_level_setting,
    port_setting,
    resolve,
    setting,
    settings_repr,
)

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


def default_data_dir(database_url: str) -> str:
    """The folder of the SQLite file, else .loraplane/ (where the spool lives)."""
    parsed = make_url(database_url)
    if parsed.drivername.startswith("sqlite") and parsed.database and parsed.database != ":memory:":
        return str(Path(parsed.database).resolve().parent)
    return str(Path.cwd() / ".loraplane")


def without_password(url: str) -> str:
    """A database URL as logs and repr may show it."""
    return make_url(url).render_as_string(hide_password=True)


def _without_query(url: str) -> str:
    return url.split("?")[0]  # a presigned or credentialed store URL keeps its secrets in the query


def parse_max_replicas(raw: str) -> int:
    """A replica maximum: a count, or `all` (stored as 0)."""
    try:
        return 0 if raw.strip().lower() == "all" else int(raw)
    except ValueError:
        raise ValueError(f"expected a count or 'all', not {raw!r}") from None


def parse_engine_credentials(items: list[str]) -> dict[str, str]:
    """`name=token` items (names hold no `=` or `,`; a token may contain `=`). Messages name the entry's
    position, never a token."""
    out: dict[str, str] = {}
    for i, item in enumerate(items, 1):
        name, sep, token = item.partition("=")
        if not sep or not name or not token:
            raise ValueError(f"entry #{i} is not name=token")
        if name in out:
            raise ValueError(f"names engine {name!r} twice")
        out[name] = token
    return out


_TOKEN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")


def token_id(token: str) -> str:
    """A token's stable short id: a sha256 prefix, useless for recovering the token."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def split_token_names(entries: tuple[str, ...], names: dict[str, str]) -> tuple[str, ...]:
    """The tokens of `name=token` and bare `token` entries; each name goes into `names` under its
    token's id. A name is a letter, then up to 63 of letters, digits and `._-`; an entry whose part
    before the first `=` is no such name (or whose rest is empty, as base64 padding) is a bare token."""
    tokens = []
    for entry in entries:
        name, sep, token = entry.partition("=")
        if sep and token and _TOKEN_NAME.fullmatch(name):
            if name in names.values() and names.get(token_id(token)) != name:
                raise ValueError(f"two tokens are named {name!r}; give each token its own name")
            names[token_id(token)] = name
            tokens.append(token)
        else:
            tokens.append(entry)
    return tuple(tokens)


ENGINES, REPLICAS, ARTIFACTS, TENANTS = "engines", "replicas and scaling", "artifacts", "tenants and keys"


@dataclass
class ControlPlaneSettings:
    """The control plane's settings: `loraplane control --help` is generated from these fields
    (shared/settings.py); most come from LORAPLANE_* variables only, the secrets among them always."""

    host: str = host_setting(env="LORAPLANE_HOST")
    port: int = port_setting(8080, env="LORAPLANE_PORT", free=False)
    database_url: str = setting(
        default_factory=default_database_url, flag="--database-url", env="LORAPLANE_DATABASE_URL", metavar="URL",
        mask=without_password,
        help="sqlite+aiosqlite:///… or postgresql+asyncpg://… (sqlite:// and postgresql:// are mapped to those "
        "drivers; default: an SQLite file, .loraplane/control.db under the current directory)")
    admin_tokens: tuple[str, ...] = setting((), env="LORAPLANE_ADMIN_TOKENS", secret=True,
                                            help="tokens of the admin role, comma-separated (every call); an entry "
                                            "name=token names its token in the audit trail (admin:name)")
    read_tokens: tuple[str, ...] = setting((), env="LORAPLANE_READ_TOKENS", secret=True,
                                           help="tokens of the read role, comma-separated (the GET calls); "
                                           "name=token entries as for the admin tokens")
    adapter_roots: tuple[str, ...] = setting(
        (), flag="--lora-roots", env="LORAPLANE_LORA_ROOTS", metavar="DIR", separators="," + os.pathsep,
        aliases=(Alias("--adapter-root", "the same directories"), Alias("LORAPLANE_ADAPTER_ROOTS")),
        help="directories adapters may be registered from; a load naming anything else is refused before files "
        "are read (in the variable: the OS path separator or commas between them; spelled as on the engine)")
    reconcile_interval_s: float = setting(
        30.0, flag="--reconcile-interval-s", env="LORAPLANE_RECONCILE_INTERVAL_S", group=ENGINES,
        help="seconds between two reconcile passes, which bring each engine's adapters in line with its placements")
    engine_timeout_s: float = setting(10.0, env="LORAPLANE_ENGINE_TIMEOUT_S",
                                      help="the total deadline of one engine call")
    engine_fetch_min_mbps: float = setting(
        25.0, env="LORAPLANE_ENGINE_FETCH_MIN_MBPS",
        help="a load that makes the engine fetch the version from the artifact store may take "
        "LORAPLANE_ENGINE_TIMEOUT_S plus the version's size at this rate (MB/s): a stopped engine still costs a "
        "bounded wait, a large adapter the time its bytes need")
    engine_stale_after_s: float = setting(
        30.0, env="LORAPLANE_ENGINE_STALE_AFTER_S",
        help="an engine whose last heartbeat is older than this reads as stale (and gets no new placements)")
    engine_gc_after_s: float = setting(
        86400.0, flag="--engine-gc-after-s", env="LORAPLANE_ENGINE_GC_AFTER_S", group=ENGINES, metavar="S",
        default_text="a day",
        help="an engine with no heartbeat for this long is removed with its placements, as `loraplane engines "
        "remove` does, and audited (it may register again); 0 keeps stale engines until removed by hand")
    engine_token_secret: str | None = setting(
        None, env=ENGINE_SECRET_ENV, secret=True, aliases=(Alias(ENGINE_SECRET_OLD_ENV),),
        help="the secret each engine's admin token is derived from: engine NAME gets its own token (its "
        "--admin-token; `loraplane engines token NAME` prints it), sent on pushes and listings, never this secret")
    engine_credentials: Mapping[str, str] = setting(
        default_factory=dict, env="LORAPLANE_ENGINE_CREDENTIALS", secret=True, parse=parse_engine_credentials,
        help="name=token,…: the token each engine sends (its LORAPLANE_CONTROL_PLANE_TOKEN); it may register, "
        "heartbeat, resolve and drain as that name and nothing else")
    engine_allowed_networks: tuple[str, ...] = setting(
        (), env="LORAPLANE_ENGINE_ALLOWED_NETWORKS",
        help="CIDR networks, comma-separated, engine URLs must point into; unset, any address but link-local and "
        "cloud-metadata ones is accepted")
    migrate_on_start: bool = setting(True, help="apply Alembic migrations when the app starts (the CLI's `db` "
                                     "commands set this off)")
    artifact_store: str | None = setting(
        None, flag="--artifact-store", env="LORAPLANE_ARTIFACT_STORE", group=ARTIFACTS, metavar="URL",
        mask=_without_query,
        help="where every version's bytes are kept (control_plane/artifacts/store.py): file:///path or "
        "s3://bucket/prefix (AWS_* variables for credentials, region, AWS_ENDPOINT_URL); default: an `artifacts` "
        "folder beside the SQLite file, or .loraplane/artifacts/ with PostgreSQL")
    max_artifact_bytes: int = setting(
        4 << 30, flag="--max-artifact-bytes", env="LORAPLANE_MAX_ARTIFACT_BYTES", group=ARTIFACTS, metavar="N",
        default_text="4 GiB",
        help="the largest version a load or upload may bring in, all its files together (413 above it)")
    data_dir: str | None = setting(
        None, flag="--data-dir", env="LORAPLANE_DATA_DIR", group=ARTIFACTS, metavar="DIR",
        help="the control plane's own folder: incoming versions are spooled in its spool/ (what a killed process "
        "left there is removed at start); default: the SQLite file's folder, or .loraplane/ with PostgreSQL")
    store_gc_grace_s: float = setting(
        3600.0, flag="--store-gc-grace-s", env="LORAPLANE_STORE_GC_GRACE_S", group=ARTIFACTS, metavar="S",
        help="store objects no version names (an upload killed before its commit) are removed once older than "
        "this; the store is walked at start and every this many seconds")
    upload_idle_timeout_s: float = setting(
        30.0, flag="--upload-idle-timeout-s", env="LORAPLANE_UPLOAD_IDLE_TIMEOUT_S", group=ARTIFACTS, metavar="S",
        help="an upload whose body sends nothing for this long is cut off (408) and its connection closed")
    public_url: str | None = setting(
        None, flag="--public-url", env="LORAPLANE_PUBLIC_URL", group=ARTIFACTS, metavar="URL",
        help="how engines reach this control plane, for absolute artifact URLs; unset, engines resolve artifact "
        "paths against their own --control-plane")
    router_tokens: tuple[str, ...] = setting(
        (), env="LORAPLANE_ROUTER_TOKENS", secret=True,
        help="tokens of routers, comma-separated: they may read routes, report demand and ask for placements, "
        "nothing else; name=token entries as for the admin tokens")
    default_min_replicas: int = setting(
        1, flag="--default-min-replicas", env="LORAPLANE_DEFAULT_MIN_REPLICAS", group=REPLICAS, metavar="N",
        help="engines holding an adapter that sets no replicas.min")
    default_max_replicas: int = setting(
        3, flag="--default-max-replicas", env="LORAPLANE_DEFAULT_MAX_REPLICAS", group=REPLICAS, metavar="N|all",
        parse=parse_max_replicas,
        help="the most engines demand scaling gives an adapter that sets no replicas.max (all: every matching "
        "engine, stored as 0)")
    scale_up_load_per_replica: float = setting(
        8.0, env="LORAPLANE_SCALE_UP_LOAD_PER_REPLICA",
        help="demand scaling (control_plane/domain/placements): a replica more when waiting+running requests per "
        "replica stay above this for LORAPLANE_SCALE_WINDOW_S")
    scale_window_s: float = setting(30.0, env="LORAPLANE_SCALE_WINDOW_S",
                                    help="the window of demand scaling: at most one change per adapter per window")
    scale_down_idle_s: float = setting(300.0, env="LORAPLANE_SCALE_DOWN_IDLE_S",
                                       help="a replica less after an adapter has been idle this long")
    rebalance_max_moves: int = setting(
        4, env="LORAPLANE_REBALANCE_MAX_MOVES",
        help="how many placements one reconcile interval may move to rebalance onto returning or new engines")
    reconcile_concurrency: int = setting(
        8, env="LORAPLANE_RECONCILE_CONCURRENCY",
        help="engines reconciled at once: each round holds a database connection while it calls its engine, so "
        "too many at once take the whole pool and heartbeats wait past the stale-after")
    reconcile_engine_calls: int = setting(
        8, env="LORAPLANE_RECONCILE_ENGINE_CALLS",
        help="loads and unloads one round sends its engine at once (a pass that places many adapters per engine "
        "would take longer than a round may, one at a time)")
    ui_session_secret: str | None = setting(
        None, env="LORAPLANE_UI_SESSION_SECRET", secret=True,
        help="signs the web console's session cookies (16 characters or more); replicas must share it. Unset, "
        "the console draws a random one per process: sessions then survive no restart and span no replicas")
    redis_url: str | None = setting(
        None, env="LORAPLANE_REDIS_URL", secret=True,
        help="Redis, where key revocations and tenants' new quotas are published to the routers at once; unset, "
        "routers see them within their key cache TTL")
    redis_prefix: str = setting("loraplane:", env="LORAPLANE_REDIS_PREFIX",
                                help="the routers' --redis-prefix (one per fleet sharing a Redis)")
    key_pepper: str | None = setting(
        None, env=PEPPER_ENV, secret=True,
        help=f"tenant keys' hashes are HMAC-SHA256 under this pepper ({MIN_PEPPER_CHARS} characters or more; every "
        "router needs the same); unset, no key can be made (503) and only legacy argon2 hashes verify")
    key_failures_per_address: int = setting(
        20, env="LORAPLANE_KEY_FAILURES_PER_ADDRESS",
        help="failed tenant-key attempts from one address within LORAPLANE_KEY_FAILURE_WINDOW_S, past which they "
        "are answered 429 without a hash (shared/key_checks.py)")
    key_failures_per_key: int = setting(100, env="LORAPLANE_KEY_FAILURES_PER_KEY",
                                        help="failed attempts of one key id, from any addresses, past which its "
                                        "offers are answered 429 (its verified secret still passes)")
    key_failure_window_s: float = setting(60.0, env="LORAPLANE_KEY_FAILURE_WINDOW_S",
                                          help="the window over which failed tenant-key attempts are counted")
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()
    # filled from the `name=token` entries of the token lists (token id -> name); no flag, no variable
    token_names: Mapping[str, str] = setting(default_factory=dict, parse=dict,
                                             help="the tokens' names, by token id, as the audit trail shows them")

    __repr__ = __str__ = settings_repr  # tokens, secrets and the database password hidden

    def __post_init__(self) -> None:
        self.log_level = self.log_level.lower()
        check_choices(self)
        self.token_names = dict(self.token_names)
        self.admin_tokens = split_token_names(tuple(self.admin_tokens), self.token_names)
        self.read_tokens = split_token_names(tuple(self.read_tokens), self.token_names)
        self.router_tokens = split_token_names(tuple(self.router_tokens), self.token_names)
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
        if self.engine_gc_after_s and not self.engine_gc_after_s >= self.engine_stale_after_s:
            raise ValueError("engine_gc_after_s must be 0 (off) or at least engine_stale_after_s: an engine is "
                             "removed only once it reads as stale")
        if self.engine_token_secret is not None and (not self.engine_token_secret
                                                 or any(c.isspace() for c in self.engine_token_secret)):
            raise ValueError(f"{ENGINE_SECRET_ENV} is empty or contains whitespace")
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
        if self.data_dir is None:
            self.data_dir = default_data_dir(self.database_url)
        if self.max_artifact_bytes <= 0:
            raise ValueError("max_artifact_bytes must be positive")
        if not self.upload_idle_timeout_s > 0 or not self.store_gc_grace_s > 0:
            raise ValueError("upload_idle_timeout_s and store_gc_grace_s must be positive")
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

    def load_deadline_s(self, size_bytes: int) -> float:
        """How long a load that fetches `size_bytes` from the artifact store may take."""
        return self.engine_timeout_s + size_bytes / (self.engine_fetch_min_mbps * 1e6)

    @property
    def safe_database_url(self) -> str:
        return without_password(self.database_url)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ControlPlaneSettings:
        """Settings from `LORAPLANE_*` variables; `overrides` (from flags, not None) take precedence. A
        deprecated variable warns (FutureWarning)."""
        values, deprecated = resolve(cls, os.environ if env is None else env, overrides)
        for message in deprecated:
            warnings.warn(message, FutureWarning, stacklevel=2)
        return cls(**values)


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
