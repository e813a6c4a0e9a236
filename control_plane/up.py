"""`loraplane up`: the whole stack on one machine — the control plane on a SQLite file, `--engines N` engines
(default 1) registered with it, the router in front of them, and (on the demo model) the demo adapters
loaded through the control plane. Clients use the OpenAI API of the router.

    loraplane up [--engines N] [--demo-dir .demo/model | --model DIR [--served-model-name NAME]]
                 [--router-port 8000] [--port 8080] [--engine-port 8100] [--database-url URL]
                 [--lora-roots DIR ...] [--engine-threads T] [--log-format text|json]
                 [--require-api-key [--redis-url URL]]

With --require-api-key the router requires client keys (docs/tenants.md#tenancy-under-loraplane-up): `up`
starts redis-server from PATH on a free port of 127.0.0.1 (a password made per start, in its configuration on
its stdin; no persistence) unless --redis-url or LORAPLANE_REDIS_URL names one, hands the URL to the control
plane and the router, makes the demo adapters public while nobody owns them, and keeps tenant `default`'s
first key in .loraplane/tenant-key (0600; reused while the control plane holds it unrevoked). Engine names an
earlier `up` in this folder started (its .loraplane/engine-cp-token* files) and this one does not run are
deregistered.

Engine i listens on --engine-port + i. With more than one engine, the engines share this host's CPUs:
each gets `--omp-threads-bind nobind` ("auto" would bind every engine's core to the same last CPUs)
and, on `--device cpu` or `auto` (treated as the CPU: `up` does not import torch to resolve it),
`--num-threads` CPUs // N, at least 1. `--engine-threads T` passes T instead, on any device and
with one engine too. Alone, an engine takes one torch thread per CPU (all but one from 4 CPUs up),
so N of them busy at once would put N threads on every CPU, and each parallel region of theirs
would wait at its barrier for a thread the scheduler had set aside (see
docs/performance.md#engine-threads-and-openmp).

Every child logs in the one format (shared/logging_setup.py) on stderr; what `up` itself reports (each
load, where the stack is) goes to stdout.

Tokens (see docs/control-plane.md#credentials), each from the environment when set, otherwise made at
random and written (mode 0600) under .loraplane/ — never printed, and passed to the children only
through their environment, never on their command lines (visible to every user in `ps`):
- the control plane's admin token: LORAPLANE_ADMIN_TOKENS, else .loraplane/admin-token;
- the secret the engines' admin tokens are derived from (the control plane's LORAPLANE_ENGINE_ADMIN_TOKEN):
  LORAPLANE_ENGINE_ADMIN_TOKEN (or the file LORAPLANE_ENGINE_ADMIN_TOKEN_FILE names; or its old name
  LORAPLANE_ENGINE_TOKEN), else .loraplane/engine-token; each engine gets only its own token derived from
  it (control_plane/engine_tokens.py) as LORAPLANE_ADMIN_TOKEN;
- each engine's own token at the control plane (LORAPLANE_ENGINE_CREDENTIALS `name=…` there,
  LORAPLANE_CONTROL_PLANE_TOKEN on the engine): .loraplane/engine-cp-token[-NAME];
- the router's token at the control plane (LORAPLANE_ROUTER_TOKENS there, LORAPLANE_ROUTER_TOKEN on the
  router): LORAPLANE_ROUTER_TOKEN, else .loraplane/router-token;
- the engines' inference key, which only the router sends (--api-key on the engines, LORAPLANE_ENGINE_API_KEY
  on the router): LORAPLANE_ENGINE_API_KEY, else .loraplane/engine-api-key;
- client keys of the router: LORAPLANE_API_KEYS when set (else the router is open, as an engine without
  --api-key);
- the pepper of tenant keys' hashes, which the control plane and the router share (LORAPLANE_KEY_PEPPER
  on both): LORAPLANE_KEY_PEPPER (or the file LORAPLANE_KEY_PEPPER_FILE names), else .loraplane/key-pepper
  (made once: another pepper would invalidate every key made with this one).
Each child gets only the tokens it uses.

Ctrl-C, SIGTERM or SIGHUP (as a process manager sends) stops the router, then the engines (together: each
drains), then the control plane: each is sent SIGTERM, waited for, and killed if it has not exited within
STOP_TIMEOUT_S; none is left running.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis as redis_client

from control_plane.engine_tokens import engine_admin_token, engine_secret_from
from control_plane.settings import split_token_names, without_password
from shared.cpus import available_cpus
from shared.key_secrets import PEPPER_ENV
from shared.logging_setup import configure_logging
from shared.secret_env import read_secret
from shared.settings import (
    SettingsParser,
    check_choices,
    from_args,
    host_setting,
    log_format_setting,
    port_setting,
    setting,
    settings_repr,
)

STATE_DIR = Path(".loraplane")
DEMO_ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")
ENGINE_NAME = "local"  # the engine's name when there is one; local-1, local-2, … when there are more
STOP_TIMEOUT_S = 45.0  # above the engine's default --shutdown-timeout-s (30): a drain is let finish
# Secrets of one role are not handed to another child (nor inherited from the caller's environment).
_SECRETS = ("LORAPLANE_ADMIN_TOKENS", "LORAPLANE_READ_TOKENS", "LORAPLANE_ENGINE_TOKEN", "LORAPLANE_ENGINE_ADMIN_TOKEN",
            "LORAPLANE_ENGINE_TOKEN_FILE", "LORAPLANE_ENGINE_ADMIN_TOKEN_FILE",
            "LORAPLANE_ENGINE_CREDENTIALS", "LORAPLANE_ADMIN_TOKEN", "LORAPLANE_CONTROL_PLANE_TOKEN",
            "LORAPLANE_API_KEY", "LORAPLANE_ENGINE_API_KEY", "LORAPLANE_ROUTER_TOKEN", "LORAPLANE_ROUTER_TOKENS",
            "LORAPLANE_API_KEYS", "LORAPLANE_KEY_PEPPER", "LORAPLANE_KEY_PEPPER_FILE", "LORAPLANE_REDIS_URL",
            "LORAPLANE_REDIS_URL_FILE")
TENANT = "default"  # the tenant of the first key `up --require-api-key` writes
TENANT_KEY_FILE = STATE_DIR / "tenant-key"


class _Stopped(Exception):
    """A stop signal arrived: unwind, stopping the children."""


@dataclass
class UpConfig:
    """`loraplane up`'s flags (its parser is generated from these fields: shared/settings.py)."""

    engines: int = setting(1, flag="--engines", help="how many engines to start")
    demo_dir: Path = setting(Path(".demo/model"), flag="--demo-dir", metavar="DIR",
                             help="the demo model (written if missing)")
    model: Path | None = setting(None, flag="--model", metavar="DIR",
                                 help="serve this checkpoint instead of the demo model (no demo adapters)")
    served_model_name: str | None = setting(None, flag="--served-model-name", metavar="NAME",
                                            help="the name clients pass as `model` (default: demo, or --model's "
                                            "folder name)")
    lora_roots: list[str] = setting(default_factory=list, flag="--lora-roots", metavar="DIR",
                                    help="folders adapters may be loaded from by path (default: the demo adapters' "
                                    "folder)")
    host: str = host_setting()
    router_port: int = setting(8000, flag="--router-port", group="HTTP", metavar="PORT",
                               help="the port of the OpenAI API (the router)")
    port: int = port_setting(8080, free=False, what="of the control plane")
    engine_port: int = setting(8100, flag="--engine-port", group="HTTP", metavar="PORT",
                               help="the first engine's port; engine i listens on this + i")
    database_url: str | None = setting(None, flag="--database-url", metavar="URL", mask=without_password,
                                       help=f"the control plane's database (default: SQLite under {STATE_DIR}/)")
    device: str = setting("auto", flag="--device", help="the engines' device (auto | cpu | cuda | npu)")
    engine_threads: int | None = setting(None, flag="--engine-threads", metavar="T",
                                         help="torch threads of each engine, on any device (default: on the CPU, "
                                         "this host's CPUs shared among the engines when there are several; else "
                                         "the engine's own default)")
    log_format: str = log_format_setting()  # of every process of the stack
    require_api_key: bool = setting(
        False, flag="--require-api-key", group="tenants",
        help=f"the router refuses clients without a key and applies tenants' quotas and private adapters; a "
        f"first key of tenant {TENANT!r} is written to {STATE_DIR}/tenant-key, the demo adapters are public")
    redis_url: str | None = setting(
        None, flag="--redis-url", env="LORAPLANE_REDIS_URL", mask=without_password, metavar="URL", group="tenants",
        help="the Redis of the quotas and key revocations, with --require-api-key; a URL with a password belongs "
        "in LORAPLANE_REDIS_URL, off the command line (unset: `up` starts redis-server from PATH on a free port "
        "of 127.0.0.1, with no persistence, and stops it with the stack)")

    __repr__ = settings_repr

    def __post_init__(self) -> None:
        check_choices(self)
        for flag, value in (("--engines", self.engines), ("--engine-threads", self.engine_threads)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1")


def _parser() -> SettingsParser:
    return SettingsParser(UpConfig, prog="loraplane up", description=__doc__.split("\n\n")[0])


def _token(env_names: tuple[str, ...], file_name: str, nbytes: int = 24) -> tuple[str, Path | None]:
    for env_name in env_names:
        if os.environ.get(env_name):
            return os.environ[env_name].split(",")[0], None
    path = STATE_DIR / file_name
    if not path.exists():
        STATE_DIR.mkdir(exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(nbytes))
    return path.read_text().strip(), path


def _admin_token() -> tuple[str, Path | None]:
    """The admin token `up` calls the control plane with: LORAPLANE_ADMIN_TOKENS' first entry (its token
    when the entry is `name=token`), else .loraplane/admin-token's."""
    entry, path = _token(("LORAPLANE_ADMIN_TOKENS",), "admin-token")
    return split_token_names((entry,), {})[0], path


def _wait(url: str, headers: dict[str, str], ok: Callable[[httpx.Response], bool], what: str,
          processes: list[subprocess.Popen[bytes]], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise SystemExit(f"loraplane up: the {what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(url, headers=headers, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        time.sleep(0.3)
    raise SystemExit(f"loraplane up: the {what} was not ready within {timeout_s:.0f}s")


@dataclass(frozen=True)
class _Child:
    what: str  # for messages: "control plane", "engine local-1", "router"
    cmd: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class _Launch:
    control: _Child
    engines: list[_Child]
    router: _Child
    engine_names: list[str]
    cp_url: str
    router_url: str
    engine_urls: list[str]
    admin: str
    admin_file: Path | None
    client_key: str | None  # one of LORAPLANE_API_KEYS, to check the router's model list with
    served: str
    adapters: dict[str, Path]  # demo adapters to load: name -> folder (none with --model)
    require_api_key: bool = False
    redis: _Child | None = None  # the redis-server `up` starts (--require-api-key without --redis-url)
    redis_config: str = ""  # its configuration, on its stdin (the password never on a command line)
    redis_port: int = 0


def engine_thread_flags(engines: int, device: str, engine_threads: int | None, cpus: int) -> list[str]:
    """The flags that share `cpus` CPUs among `engines` engines on this host (module docstring): the
    thread split only on the CPU (an accelerator's torch threads run host-side ops alone), no binding
    whenever there are several, and `engine_threads` as given when it is."""
    if engine_threads is None and engines > 1 and device.split(":")[0] in ("auto", "cpu"):
        engine_threads = max(1, cpus // engines)
    threads = ["--num-threads", str(engine_threads)] if engine_threads is not None else []
    return threads + (["--omp-threads-bind", "nobind"] if engines > 1 else [])


def _launch(args: UpConfig) -> _Launch:
    """The children's command lines and environments, and the tokens they share."""
    demo = args.demo_dir
    model = args.model if args.model is not None else demo
    served = args.served_model_name or ("demo" if args.model is None else args.model.resolve().name)
    roots = [str(Path(r)) for r in args.lora_roots] or ([str(demo / "adapters")] if args.model is None else [])
    adapters = {} if args.model is not None else {n: (demo / "adapters" / n).resolve() for n in DEMO_ADAPTERS}
    names = [ENGINE_NAME] if args.engines == 1 else [f"{ENGINE_NAME}-{i + 1}" for i in range(args.engines)]
    admin, admin_file = _admin_token()
    engine_secret = engine_secret_from(os.environ) or _token((), "engine-token")[0]
    engine_cp = {n: _token((), "engine-cp-token" if n == ENGINE_NAME else f"engine-cp-token-{n}")[0] for n in names}
    router_token, _ = _token(("LORAPLANE_ROUTER_TOKEN",), "router-token")
    engine_key, _ = _token(("LORAPLANE_ENGINE_API_KEY",), "engine-api-key")
    pepper = read_secret(os.environ, PEPPER_ENV) or _token((), "key-pepper", nbytes=32)[0]
    client_keys = os.environ.get("LORAPLANE_API_KEYS", "")
    host, log = args.host, ["--log-format", args.log_format]
    cp_url = f"http://{host}:{args.port}"
    base_env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
    control_env = {**base_env, "LORAPLANE_ADMIN_TOKENS": os.environ.get("LORAPLANE_ADMIN_TOKENS") or admin,
                   "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_secret, "LORAPLANE_ROUTER_TOKENS": router_token,
                   "LORAPLANE_ENGINE_CREDENTIALS": ",".join(f"{n}={t}" for n, t in engine_cp.items()),
                   "LORAPLANE_KEY_PEPPER": pepper}
    if os.environ.get("LORAPLANE_READ_TOKENS"):
        control_env["LORAPLANE_READ_TOKENS"] = os.environ["LORAPLANE_READ_TOKENS"]
    launcher = [sys.executable, "-m", "shared.cli"]
    control_cmd = [*launcher, "control", "--host", host, "--port", str(args.port), *log]
    if roots:
        control_cmd += ["--lora-roots", *roots]
    if args.database_url:
        control_cmd += ["--database-url", args.database_url]
    engines, urls = [], []
    threads = engine_thread_flags(args.engines, args.device, args.engine_threads, len(available_cpus()))
    for i, name in enumerate(names):
        port = args.engine_port + i
        urls.append(f"http://{host}:{port}")
        # the engine reads --admin-token (its own, never the secret) from LORAPLANE_ADMIN_TOKEN, --api-key
        # from LORAPLANE_API_KEY, --control-plane-token from LORAPLANE_CONTROL_PLANE_TOKEN
        env = {**base_env, "LORAPLANE_ADMIN_TOKEN": engine_admin_token(engine_secret, name),
               "LORAPLANE_API_KEY": engine_key,
               "LORAPLANE_CONTROL_PLANE_TOKEN": engine_cp[name]}
        cmd = [*launcher, "engine", "--model", str(model), "--served-model-name", served, "--host", host,
               "--port", str(port), "--device", args.device, "--enable-lora", "--control-plane", cp_url,
               "--engine-name", name, *log, *threads,
               # its own cache of fetched versions, kept across restarts (nothing is fetched twice)
               "--lora-cache-dir", str(STATE_DIR / "lora-cache" / name)]
        if roots:
            cmd += ["--lora-roots", *roots]
        engines.append(_Child(f"engine {name}", cmd, env))
    router_env = {**base_env, "LORAPLANE_ROUTER_TOKEN": router_token, "LORAPLANE_ENGINE_API_KEY": engine_key,
                  "LORAPLANE_KEY_PEPPER": pepper}
    if client_keys:
        router_env["LORAPLANE_API_KEYS"] = client_keys
    router_cmd = [*launcher, "router", "--control-plane", cp_url, "--host", host, "--port", str(args.router_port),
                  *log]
    redis, redis_config, redis_port = None, "", 0
    if args.require_api_key:
        router_cmd.append("--require-api-key")
        redis_url = args.redis_url
        if redis_url is None:
            redis, redis_config, redis_port, redis_url = _own_redis(base_env)
        control_env["LORAPLANE_REDIS_URL"] = router_env["LORAPLANE_REDIS_URL"] = redis_url
    return _Launch(_Child("control plane", control_cmd, control_env), engines,
                   _Child("router", router_cmd, router_env), names, cp_url, f"http://{host}:{args.router_port}",
                   urls, admin, admin_file, next((k for k in client_keys.split(",") if k), None), served, adapters,
                   args.require_api_key, redis, redis_config, redis_port)


def _free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _own_redis(base_env: dict[str, str]) -> tuple[_Child, str, int, str]:
    """redis-server from PATH on a free port of 127.0.0.1: no persistence (quotas are per minute), its
    files under STATE_DIR/redis, a password made for this start (in its configuration, read from stdin)."""
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("loraplane up: --require-api-key needs a Redis for the quotas: no redis-server is on PATH; "
                         "install one (apt install redis-server, brew install redis) or pass --redis-url URL "
                         "(or set LORAPLANE_REDIS_URL)")
    folder = STATE_DIR / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    port, password = _free_local_port(), secrets.token_urlsafe(24)
    config = (f"bind 127.0.0.1\nport {port}\nsave \"\"\nappendonly no\ndir \"{folder.resolve()}\"\n"
              f"requirepass {password}\nloglevel warning\n")
    return (_Child("redis", [server, "-"], base_env), config, port,
            f"redis://:{password}@127.0.0.1:{port}/0")


def main(argv: list[str]) -> int:
    try:
        args = from_args(UpConfig, _parser().parse_args(argv))
    except ValueError as exc:
        print(f"loraplane up: {exc}", file=sys.stderr)
        return 2
    configure_logging("info", args.log_format, process="up")
    if args.model is None and not (args.demo_dir / "adapters" / "demo-short" / "adapter_config.json").exists():
        # a child process: the control plane never imports the engine (it needs the engine extra anyway)
        written = subprocess.run([sys.executable, "-m", "shared.cli", "demo-model", str(args.demo_dir)], check=False)
        if written.returncode != 0:
            return written.returncode
    launch = _launch(args)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(launch)
    except (_Stopped, KeyboardInterrupt):
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _run(launch: _Launch) -> int:
    cp_url, admin_file = launch.cp_url, launch.admin_file
    auth = {"Authorization": f"Bearer {launch.admin}"}
    with contextlib.ExitStack() as stack:  # unwinds on any exit, _Stopped included: router, engines, control
        if launch.redis is not None:  # stopped last, after the router
            redis = stack.enter_context(subprocess.Popen(launch.redis.cmd, env=launch.redis.env, stdin=subprocess.PIPE))
            stack.callback(_stop, redis)
            assert redis.stdin is not None
            redis.stdin.write(launch.redis_config.encode())
            redis.stdin.close()
            _wait_for_redis(launch.control.env["LORAPLANE_REDIS_URL"], redis)
        control = stack.enter_context(subprocess.Popen(launch.control.cmd, env=launch.control.env))
        stack.callback(_stop, control)
        _wait(cp_url + "/health", {}, lambda r: True, "control plane", [control])
        engines = [stack.enter_context(subprocess.Popen(e.cmd, env=e.env)) for e in launch.engines]
        stack.callback(_stop, *engines)

        def registered(r: httpx.Response) -> bool:
            healthy = {e["name"] for e in r.json().get("data", []) if e["state"] == "healthy"}
            return healthy >= set(launch.engine_names)

        for url in launch.engine_urls:  # /health first: a routine probe, logged at DEBUG (the listing is not)
            _wait(url + "/health", {}, lambda r: True, "engines", engines)
        _wait(cp_url + "/v1/engines", auth, registered, "engines (registering with the control plane)", engines)
        _forget_old_engines(cp_url, auth, launch.engine_names)
        tenant_key = _tenant_key(cp_url, auth) if launch.require_api_key else None
        router = stack.enter_context(subprocess.Popen(launch.router.cmd, env=launch.router.env))
        stack.callback(_stop, router)
        for name, folder in launch.adapters.items():
            r = httpx.post(cp_url + "/v1/load_lora_adapter", headers=auth, timeout=120, json={
                "lora_name": name, "lora_path": str(folder), "base_model": launch.served})
            print(f"loraplane up: load {name}: {r.status_code} "
                  f"{[(e['engine'], e['outcome']) for e in r.json().get('engines', [])]}", flush=True)
        if launch.require_api_key:
            _make_public(cp_url, auth, list(launch.adapters))
        wanted = {launch.served, *launch.adapters}
        client_key = launch.client_key or tenant_key
        key = {"Authorization": f"Bearer {client_key}"} if client_key else {}
        _wait(launch.router_url + "/health", {},
              lambda r: r.json()["routing_table"]["models"] >= len(wanted), "router", [router, control, *engines])
        _wait(launch.router_url + "/v1/models", key, lambda r: wanted <= {m["id"] for m in r.json()["data"]},
              "router (its routing table)", [router, control, *engines])
        where = f"the admin token is in {admin_file}" if admin_file else "admin token: $LORAPLANE_ADMIN_TOKENS"
        print(f"loraplane up: OpenAI API at {launch.router_url}/v1 (the router), serving {sorted(wanted)}\n"
              f"  control plane {cp_url} ({where}), engines {', '.join(launch.engine_urls)}\n"
              f"  curl -H \"Authorization: Bearer $(cat {admin_file or '<token>'})\" {cp_url}/v1/lora_adapters",
              flush=True)
        if tenant_key is not None:
            print(f"  tenancy on: the router requires a key; tenant {TENANT!r}'s first key is in {TENANT_KEY_FILE}",
                  flush=True)
        children = [control, router, *engines]
        try:
            while all(p.poll() is None for p in children):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def _wait_for_redis(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    client = redis_client.Redis.from_url(url, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"loraplane up: redis-server exited with {process.returncode}")
        with contextlib.suppress(redis_client.RedisError):
            if client.ping():
                return
        time.sleep(0.1)
    raise SystemExit(f"loraplane up: redis-server was not ready within {timeout_s:.0f}s")


def _forget_old_engines(cp_url: str, auth: dict[str, str], names: list[str]) -> None:
    """Deregister the engines an earlier `up` on this folder started and this one does not (`local` after
    `--engines 3`, `local-3` after going back to 1): their token files say which names those were."""
    for path in sorted(STATE_DIR.glob("engine-cp-token*")):
        name = path.name.removeprefix("engine-cp-token").removeprefix("-") or ENGINE_NAME
        if name in names:
            continue
        r = httpx.delete(f"{cp_url}/v1/engines/{name}", headers=auth, timeout=30)
        if r.status_code in (200, 404):
            if r.status_code == 200:
                print(f"loraplane up: removed engine {name} (started by an earlier `up`, not by this one)", flush=True)
            path.unlink(missing_ok=True)


def _tenant_key(cp_url: str, auth: dict[str, str]) -> str:
    """Tenant TENANT's first key, from TENANT_KEY_FILE while the control plane still knows it (not revoked,
    not expired); else a tenant and a key made now (an inference key: the router's), written there."""
    tenant = f"{cp_url}/v1/tenants/{TENANT}"
    if TENANT_KEY_FILE.exists():
        key = TENANT_KEY_FILE.read_text().strip()
        listed = httpx.get(tenant + "/keys", headers=auth, timeout=30)
        now = dt.datetime.now(dt.UTC)
        if listed.status_code == 200 and any(
                key.startswith(f"lp_{k['key_id']}_") and k["revoked_at"] is None
                and (k["expires_at"] is None or dt.datetime.fromisoformat(k["expires_at"]) > now)
                for k in listed.json()["data"]):
            return key
    if httpx.get(tenant, headers=auth, timeout=30).status_code == 404:
        made = httpx.post(f"{cp_url}/v1/tenants", headers=auth, timeout=30,
                          json={"name": TENANT, "display_name": "made by loraplane up"})
        if made.status_code != 201:
            raise SystemExit(f"loraplane up: could not create tenant {TENANT!r}: {made.status_code} {made.text}")
    made = httpx.post(tenant + "/keys", headers=auth, timeout=30, json={"name": "loraplane-up", "scopes": ["inference"]})
    if made.status_code != 201:
        raise SystemExit(f"loraplane up: could not create a key of tenant {TENANT!r}: {made.status_code} {made.text}")
    TENANT_KEY_FILE.unlink(missing_ok=True)
    TENANT_KEY_FILE.touch(mode=0o600)
    TENANT_KEY_FILE.write_text(made.json()["key"])
    return str(made.json()["key"])


def _make_public(cp_url: str, auth: dict[str, str], names: list[str]) -> None:
    """The demo adapters, while nobody owns them, become public: every tenant's keys may use them."""
    table = httpx.get(f"{cp_url}/v1/tenancy/adapters", headers=auth, timeout=30).json()["adapters"]
    for entry in table:
        if entry["name"] in names and entry["owner"] is None and not entry["public"]:
            httpx.put(f"{cp_url}/v1/tenancy/adapters/{entry['name']}", headers=auth, timeout=30,
                      json={"owner": None, "public": True})


def _stop(*processes: subprocess.Popen[bytes]) -> None:
    """SIGTERM to all, wait, SIGKILL whoever is left after STOP_TIMEOUT_S; all reaped. A second stop signal
    meanwhile does not interrupt this (it would leave a child running)."""
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
            process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
