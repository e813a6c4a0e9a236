"""`loraplane up`: the whole stack on one machine — the control plane on a SQLite file, one engine on the
demo model registered with it, and the demo adapters loaded through the control plane.

    loraplane up [--demo-dir .demo/model] [--port 8080] [--engine-port 8000] [--database-url URL]
                 [--log-format text|json]

Both children log in the one format (shared/logging_setup.py) on stderr; what `up` itself reports (each
load, where the stack is) goes to stdout.

Tokens (see ../shared/DESIGN.md § Credentials), each from the environment when set, otherwise made at
random and written (mode 0600) under .loraplane/ — never printed, and passed to the children only
through their environment, never on their command lines (visible to every user in `ps`):
- the control plane's admin token: LORAPLANE_ADMIN_TOKENS, else .loraplane/admin-token;
- the engine's admin token, which the control plane pushes with: LORAPLANE_ENGINE_ADMIN_TOKEN
  (or its old name LORAPLANE_ENGINE_TOKEN), else .loraplane/engine-token;
- the engine's own token at the control plane (LORAPLANE_ENGINE_CREDENTIALS `local=…` there,
  LORAPLANE_CONTROL_PLANE_TOKEN on the engine): .loraplane/engine-cp-token.
Each child gets only the tokens it uses.

Ctrl-C, SIGTERM or SIGHUP (as a process manager sends) stops the engine, then the control plane: each is
sent SIGTERM, waited for, and killed if it has not exited within STOP_TIMEOUT_S; none is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.logging_setup import add_log_format_argument, configure_logging

STATE_DIR = Path(".loraplane")
DEMO_ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")
ENGINE_NAME = "local"
STOP_TIMEOUT_S = 45.0  # above the engine's default --shutdown-timeout-s (30): a drain is let finish
# Secrets of one role are not handed to the other child (nor inherited from the caller's environment).
_SECRETS = ("LORAPLANE_ADMIN_TOKENS", "LORAPLANE_READ_TOKENS", "LORAPLANE_ENGINE_TOKEN", "LORAPLANE_ENGINE_ADMIN_TOKEN",
            "LORAPLANE_ENGINE_CREDENTIALS", "LORAPLANE_ADMIN_TOKEN", "LORAPLANE_CONTROL_PLANE_TOKEN",
            "LORAPLANE_API_KEY", "LORAPLANE_ENGINE_API_KEY")


class _Stopped(Exception):
    """A stop signal arrived: unwind, stopping the children."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane up", description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", type=Path, default=Path(".demo/model"), help="demo model (written if missing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="control plane port")
    p.add_argument("--engine-port", type=int, default=8000)
    p.add_argument("--database-url", help=f"default: sqlite under {STATE_DIR}/")
    p.add_argument("--device", default="auto", help="engine device (auto | cpu | cuda | npu)")
    add_log_format_argument(p)  # of every process of the stack
    return p


def _token(env_names: tuple[str, ...], file_name: str) -> tuple[str, Path | None]:
    for env_name in env_names:
        if os.environ.get(env_name):
            return os.environ[env_name].split(",")[0], None
    path = STATE_DIR / file_name
    if not path.exists():
        STATE_DIR.mkdir(exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(24))
    return path.read_text().strip(), path


def _wait(url: str, headers: dict[str, str], ok: Callable[[httpx.Response], bool], what: str,
          process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"loraplane up: the {what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(url, headers=headers, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        time.sleep(0.3)
    raise SystemExit(f"loraplane up: the {what} was not ready within {timeout_s:.0f}s")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    configure_logging("info", args.log_format)
    demo = args.demo_dir
    if not (demo / "adapters" / "demo-short" / "adapter_config.json").exists():
        # a child process: the control plane never imports the engine (it needs the engine extra anyway)
        written = subprocess.run([sys.executable, "-m", "shared.cli", "demo-model", str(demo)], check=False)
        if written.returncode != 0:
            return written.returncode
    admin, admin_file = _token(("LORAPLANE_ADMIN_TOKENS",), "admin-token")
    engine_admin, _ = _token(("LORAPLANE_ENGINE_ADMIN_TOKEN", "LORAPLANE_ENGINE_TOKEN"), "engine-token")
    engine_cp, _ = _token((), "engine-cp-token")
    cp_url = f"http://{args.host}:{args.port}"
    base_env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
    control_env = {**base_env, "LORAPLANE_ADMIN_TOKENS": os.environ.get("LORAPLANE_ADMIN_TOKENS") or admin,
                   "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin,
                   "LORAPLANE_ENGINE_CREDENTIALS": f"{ENGINE_NAME}={engine_cp}"}
    if os.environ.get("LORAPLANE_READ_TOKENS"):
        control_env["LORAPLANE_READ_TOKENS"] = os.environ["LORAPLANE_READ_TOKENS"]
    # the engine reads --admin-token from LORAPLANE_ADMIN_TOKEN, --control-plane-token from LORAPLANE_CONTROL_PLANE_TOKEN
    engine_env = {**base_env, "LORAPLANE_ADMIN_TOKEN": engine_admin, "LORAPLANE_CONTROL_PLANE_TOKEN": engine_cp}
    control_cmd = [sys.executable, "-m", "shared.cli", "control", "--host", args.host, "--port", str(args.port),
                   "--lora-roots", str(demo / "adapters"), "--log-format", args.log_format]
    if args.database_url:
        control_cmd += ["--database-url", args.database_url]
    engine_cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(demo), "--served-model-name", "demo",
                  "--host", args.host, "--port", str(args.engine_port), "--device", args.device, "--enable-lora",
                  "--lora-roots", str(demo / "adapters"), "--control-plane", cp_url, "--engine-name", ENGINE_NAME,
                  # its own cache of fetched versions, kept across restarts (nothing is fetched twice)
                  "--lora-cache-dir", str(Path(".loraplane") / "lora-cache" / ENGINE_NAME),
                  "--log-format", args.log_format]
    launch = _Launch(control_cmd, control_env, engine_cmd, engine_env, cp_url, admin, admin_file)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args, demo, launch)
    except (_Stopped, KeyboardInterrupt):
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


@dataclass(frozen=True)
class _Launch:
    control_cmd: list[str]
    control_env: dict[str, str]
    engine_cmd: list[str]
    engine_env: dict[str, str]
    cp_url: str
    admin: str
    admin_file: Path | None


def _run(args: argparse.Namespace, demo: Path, launch: _Launch) -> int:
    cp_url, admin_file = launch.cp_url, launch.admin_file
    auth = {"Authorization": f"Bearer {launch.admin}"}
    with contextlib.ExitStack() as stack:  # unwinds on any exit, _Stopped included: engine first, then control
        control = stack.enter_context(subprocess.Popen(launch.control_cmd, env=launch.control_env))
        stack.callback(_stop, control)
        _wait(cp_url + "/health", {}, lambda r: True, "control plane", control)
        engine = stack.enter_context(subprocess.Popen(launch.engine_cmd, env=launch.engine_env))
        stack.callback(_stop, engine)

        def registered(r: httpx.Response) -> bool:
            return any(e["name"] == ENGINE_NAME and e["state"] == "healthy" for e in r.json().get("data", []))

        _wait(cp_url + "/v1/engines", auth, registered, "engine (registering with the control plane)", engine)
        for name in DEMO_ADAPTERS:
            r = httpx.post(cp_url + "/v1/load_lora_adapter", headers=auth, timeout=120, json={
                "lora_name": name, "lora_path": str((demo / "adapters" / name).resolve()), "base_model": "demo"})
            print(f"loraplane up: load {name}: {r.status_code} "
                  f"{[(e['engine'], e['outcome']) for e in r.json().get('engines', [])]}", flush=True)
        where = f"the admin token is in {admin_file}" if admin_file else "admin token: $LORAPLANE_ADMIN_TOKENS"
        print(f"loraplane up: control plane {cp_url}, engine http://{args.host}:{args.engine_port} ({where})\n"
              f"  curl -H \"Authorization: Bearer $(cat {admin_file or '<token>'})\" {cp_url}/v1/lora_adapters",
              flush=True)
        try:
            while control.poll() is None and engine.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, wait, SIGKILL after STOP_TIMEOUT_S; always reaped. A second stop signal meanwhile does not
    interrupt this (it would leave the child running)."""
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
