"""`loraplane up`: the whole stack on one machine — the control plane on a SQLite file, one engine on the
demo model registered with it, and the demo adapters loaded through the control plane.

    loraplane up [--demo-dir .demo/model] [--port 8080] [--engine-port 8000] [--database-url URL]

Tokens: LORAPLANE_ADMIN_TOKENS / LORAPLANE_ENGINE_TOKEN when set; otherwise random ones are made and
written (mode 0600) to .loraplane/admin-token and .loraplane/engine-token — never printed.
Ctrl-C stops both processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

STATE_DIR = Path(".loraplane")
DEMO_ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane up", description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", type=Path, default=Path(".demo/model"), help="demo model (written if missing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="control plane port")
    p.add_argument("--engine-port", type=int, default=8000)
    p.add_argument("--database-url", help=f"default: sqlite under {STATE_DIR}/")
    p.add_argument("--device", default="auto", help="engine device (auto | cpu | cuda | npu)")
    return p


def _token(env_name: str, file_name: str) -> tuple[str, Path | None]:
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
    demo = args.demo_dir
    if not (demo / "adapters" / "demo-short" / "adapter_config.json").exists():
        from data_plane.demo.cli import main as demo_model

        demo_model([str(demo)])
    admin, admin_file = _token("LORAPLANE_ADMIN_TOKENS", "admin-token")
    engine_token, _ = _token("LORAPLANE_ENGINE_TOKEN", "engine-token")
    cp_url = f"http://{args.host}:{args.port}"
    env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": os.environ.get("LORAPLANE_ADMIN_TOKENS") or admin,
           "LORAPLANE_ENGINE_TOKEN": engine_token, "LORAPLANE_CONTROL_PLANE_TOKEN": admin}
    control_cmd = [sys.executable, "-m", "shared.cli", "control", "--host", args.host, "--port", str(args.port),
                   "--adapter-root", str(demo / "adapters")]
    if args.database_url:
        control_cmd += ["--database-url", args.database_url]
    engine_cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(demo), "--served-model-name", "demo",
                  "--host", args.host, "--port", str(args.engine_port), "--device", args.device, "--enable-lora",
                  "--lora-roots", str(demo / "adapters"), "--admin-token", engine_token,
                  "--control-plane", cp_url, "--engine-name", "local"]
    auth = {"Authorization": f"Bearer {admin}"}
    with contextlib.ExitStack() as stack:
        control = stack.enter_context(subprocess.Popen(control_cmd, env=env))
        stack.callback(_stop, control)
        _wait(cp_url + "/health", {}, lambda r: True, "control plane", control)
        engine = stack.enter_context(subprocess.Popen(engine_cmd, env=env))
        stack.callback(_stop, engine)

        def registered(r: httpx.Response) -> bool:
            return any(e["name"] == "local" and e["state"] == "healthy" for e in r.json().get("data", []))

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
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
