"""`loraplane up` (control_plane.up): control plane + engines + router + the demo adapters, from nothing,
the OpenAI API served through the router (engines answer only the router's key); no secret on any child's
command line; one JSON log format for all of them; a SIGTERM (as a process manager sends) stops and reaps
the children."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from control_plane.engine_tokens import engine_admin_token
from data_plane.engine.core.threads import CORE_MODULE
from shared.cpus import available_cpus
from tests.e2e.test_control_plane_engines import _free_port


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                out += children
                todo += children
    return out


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def role_of(pid: int) -> str | None:
    """The `loraplane` command a child of `up` runs (python -m shared.cli ROLE …): engine, router, control."""
    args = _cmdline(pid).split(b"\0")
    return args[3].decode() if args[1:3] == [b"-m", b"shared.cli"] and len(args) > 3 else None


def alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_up(tmp_path: Path, cp_port: int, engine_port: int, *flags: str, stdout: IO[str],
             stderr: IO[str] | int, router_port: int | None = None,
             env: dict[str, str] | None = None) -> subprocess.Popen:
    """`loraplane up` in tmp_path (its state under tmp_path/.loraplane, the demo model in tmp_path/demo),
    with no LORAPLANE_* variable of the caller's (but those of `env` and KERNEL_BUILD) and no OMP_NUM_THREADS (up's share of
    the CPUs is checked below); the router on `router_port` (a free one if None)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_") and k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-c", "import sys; from control_plane.up import main; sys.exit(main(sys.argv[1:]))",
           "--demo-dir", str(tmp_path / "demo"), "--port", str(cp_port), "--engine-port", str(engine_port),
           "--router-port", str(router_port or _free_port()), "--device", "cpu", *flags]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=stdout, stderr=stderr,
                            env={**clean, **KERNEL_BUILD, **(env or {}), "PYTHONUNBUFFERED": "1"})


def wait_until_up(process: subprocess.Popen, out: Path, log: Path, timeout_s: float = 180) -> None:
    """Until `up` says where the stack is (on stdout, in `out`); `log` is shown if it exits first."""
    deadline = time.monotonic() + timeout_s
    while "loraplane up: OpenAI API at" not in out.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def stop_up(process: subprocess.Popen) -> None:
    """However a test ended: Ctrl-C to `up` (it stops its children), a kill if it does not exit."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# the CPU kernels as the rest of the suite's engines compile them (data_plane/model/cpu_extension.py), once,
# not again under each `up`'s fresh folder
KERNEL_BUILD = {"LORAPLANE_KERNEL_BUILD_DIR": str(Path(__file__).resolve().parents[2] / ".loraplane" / "build")}
ROUTINE = ("/heartbeat", "/metrics", "/health", "/v1/routes", "/v1/tenancy/")  # traffic logged at DEBUG only


def test_up_brings_up_the_stack_with_the_demo_adapters(tmp_path: Path) -> None:
    """Also one log format for the whole stack: with `--log-format json`, every stderr line of every process
    (ours, uvicorn's, alembic's, httpx's) is one JSON object with time, level, logger and message; the
    routine traffic (heartbeats every 3 s, sent and received; /metrics scrapes; /health probes) is not logged
    at INFO, so an idle stack prints nothing."""
    cp_port, engine_port, router_port = _free_port(), _free_port(), _free_port()
    cp, engine = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{engine_port}"
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = start_up(tmp_path, cp_port, engine_port, "--log-format", "json", stdout=stdout, stderr=stderr,
                           router_port=router_port)
    try:
        wait_until_up(process, out, err)
        ready_at = datetime.datetime.now().astimezone()  # the test's own calls follow
        token_file = tmp_path / ".loraplane" / "admin-token"
        assert token_file.stat().st_mode & 0o077 == 0
        token = token_file.read_text().strip()
        assert token not in out.read_text() + err.read_text()  # written to the file, never printed
        auth = {"Authorization": f"Bearer {token}"}
        page = httpx.get(f"http://127.0.0.1:{cp_port}/v1/lora_adapters", headers=auth, timeout=10).json()
        assert [a["name"] for a in page["data"]] == ["demo-pirate", "demo-poet", "demo-short"]
        # the OpenAI API is the router's: it lists the fleet's models and serves them from the engine
        router = f"http://127.0.0.1:{router_port}/v1"
        models = httpx.get(router + "/models", timeout=10).json()["data"]
        assert {m["id"] for m in models} == {"demo", "demo-pirate", "demo-poet", "demo-short"}
        request = {"model": "demo-poet", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        r = httpx.post(router + "/completions", timeout=60, json=request)
        assert r.status_code == 200 and r.headers["x-loraplane-engine"] == "local", r.text
        # the engine answers the router's key only
        direct = httpx.post(f"http://127.0.0.1:{engine_port}/v1/completions", timeout=60, json=request)
        assert direct.status_code == 401, direct.text

        # every secret travels in the environment: none is on a command line (readable by all in `ps`)
        names = ("admin-token", "engine-token", "engine-cp-token", "router-token", "engine-api-key", "key-pepper")
        secrets = dict(zip(names, ((tmp_path / ".loraplane" / f).read_text().strip() for f in names), strict=True))
        children = descendants(process.pid)
        assert len(children) >= 3
        for pid in children:
            cmdline = _cmdline(pid).decode(errors="replace")
            assert not any(s in cmdline for s in secrets.values()), cmdline

        def environ(role: str) -> str:
            pid = next(p for p in children if role_of(p) == role)
            return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")

        # each child holds the tokens of its role only
        engine_env, router_env = environ("engine"), environ("router")
        assert secrets["admin-token"] not in engine_env and secrets["engine-cp-token"] in engine_env
        # its own admin token, derived from the control plane's secret, which it never holds
        assert f"LORAPLANE_ADMIN_TOKEN={engine_admin_token(secrets['engine-token'], 'local')}\0" in engine_env
        assert secrets["engine-token"] not in engine_env and secrets["engine-token"] in environ("control")
        assert secrets["router-token"] not in engine_env and secrets["key-pepper"] not in engine_env
        # the tenant keys' pepper: made once, the control plane's and the router's
        assert (tmp_path / ".loraplane" / "key-pepper").stat().st_mode & 0o077 == 0
        assert secrets["key-pepper"] in environ("control") and secrets["key-pepper"] in router_env
        assert secrets["router-token"] in router_env and secrets["engine-api-key"] in router_env
        assert not any(secrets[n] in router_env for n in ("admin-token", "engine-token", "engine-cp-token"))

        # at least two heartbeats after the registration (the engine's last_heartbeat moves twice), with a
        # Prometheus scrape and a probe of each process meanwhile: routine traffic for the log check below
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline, f"heartbeats seen: {seen}"
            seen |= {e["last_heartbeat"] for e in httpx.get(cp + "/v1/engines", headers=auth, timeout=10).json()["data"]}
            for url in (cp, engine):
                assert httpx.get(url + "/metrics", timeout=10).status_code == 200
                assert httpx.get(url + "/health", timeout=10).status_code == 200
            time.sleep(0.5)

        # SIGTERM, as a process manager sends: the children are stopped and reaped, none left as an orphan
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        stop_up(process)

    printed = out.read_text() + err.read_text()
    assert not [name for name, value in secrets.items() if value in printed]  # no secret in any process's log
    lines = [json.loads(line) for line in err.read_text().splitlines()]  # every line is one JSON object
    for line in lines:
        assert {"time", "level", "process", "logger", "message"} <= set(line) <= {
            "time", "level", "process", "logger", "message", "exception"}, line
    # each line names its process: the four share one stream
    assert {line["process"] for line in lines} <= {"up", "control", "router", "engine[local]"}
    assert {"control", "router", "engine[local]"} <= {line["process"] for line in lines}
    loggers = {line["logger"] for line in lines}
    # every process's libraries log through the one handler: uvicorn (every server), alembic (the control
    # plane's migrations), and our own loggers
    assert {"uvicorn.error", "uvicorn.access", "alembic.runtime.migration"} <= loggers, loggers
    # one line per call: the receiver's access line; what a process sends (httpx) is not logged at INFO
    assert "httpx" not in loggers, [line for line in lines if line["logger"] == "httpx"][:3]
    # up's readiness polls wait on the routine probes first: its listings are asked a few times at most
    polls = [line for line in lines if datetime.datetime.fromisoformat(line["time"]) < ready_at
             and ("GET /v1/engines " in line["message"] or "GET /v1/models " in line["message"])]
    assert len(polls) <= 4, polls
    assert any(name.startswith(("loraplane", "data_plane", "control_plane")) for name in loggers), loggers
    # the control plane, the engine and the router
    assert sum(line["message"].startswith("Started server process") for line in lines) == 3
    assert not any(line["logger"] == "alembic.runtime.plugins" for line in lines)  # start-up chatter: DEBUG
    noisy = [line for line in lines if line["level"] != "DEBUG" and any(r in line["message"] for r in ROUTINE)]
    assert noisy == [], noisy


def _free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive free ports: `up` puts engine i on --engine-port + i, and a port
    next to a free one may be another process's (an engine once failed to start on it: address in use)."""
    while True:
        first = _free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return first


def test_up_with_tenancy_then_a_users_checkpoint_on_two_engines(
        tmp_path: Path) -> None:
    """`up --require-api-key` with no Redis URL: it starts redis-server from PATH (its password on no
    command line), the router refuses clients without a key, tenant `default`'s first key is in
    .loraplane/tenant-key (0600) and serves the demo adapters (public), and the control plane's /health
    names the router that enforces tenancy, so a private move answers no warning. Started again with two
    engines on a user's checkpoint (no demo adapters then) and a static client key too, it reuses the tenant
    key, deregisters `local`, the name it no longer runs, and the router spreads requests over both
    engines, which share the host's CPUs (half each, no binding) and each hold their own admin token."""
    from data_plane.demo.model_builder import write_demo_model

    cp_port, router_port = _free_port(), _free_port()
    cp, router = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{router_port}/v1"
    state = tmp_path / ".loraplane"
    request = {"model": "demo-poet", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = start_up(tmp_path, cp_port, _free_ports_in_a_row(2), "--require-api-key", stdout=stdout,
                           stderr=stderr, router_port=router_port)
    try:
        wait_until_up(process, out, err)
        assert (state / "tenant-key").stat().st_mode & 0o077 == 0
        key = (state / "tenant-key").read_text().strip()
        assert key.startswith("lp_") and key not in out.read_text() + err.read_text()
        auth = {"Authorization": f"Bearer {(state / 'admin-token').read_text().strip()}"}
        assert httpx.get(router + "/models", timeout=10).status_code == 401
        tenant = {"Authorization": f"Bearer {key}"}
        models = {m["id"] for m in httpx.get(router + "/models", headers=tenant, timeout=10).json()["data"]}
        assert models == {"demo", "demo-pirate", "demo-poet", "demo-short"}
        r = httpx.post(router + "/completions", headers=tenant, json=request, timeout=60)
        assert r.status_code == 200, r.text
        servers = [p for p in descendants(process.pid) if b"redis-server" in _cmdline(p)]
        assert len(servers) == 1
        redis_env = environ_of(next(p for p in descendants(process.pid) if role_of(p) == "router"))
        password = redis_env.split("LORAPLANE_REDIS_URL=redis://:", 1)[1].split("@", 1)[0]
        assert password and password.encode() not in _cmdline(servers[0])

        deadline = time.monotonic() + 30
        while not (health := httpx.get(cp + "/health", timeout=10).json())["tenancy"]["enforced"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert health["tenancy"]["routers"] == [f"127.0.0.1:{router_port}"]
        moved = httpx.put(cp + "/v1/tenancy/adapters/demo-pirate", headers=auth, timeout=10,
                          json={"owner": "default", "public": False})
        assert moved.status_code == 200 and moved.json()["warnings"] == [], moved.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert not [p for p in servers if alive(p)]  # the Redis stopped with the stack
    finally:
        stop_up(process)

    model = tmp_path / "checkpoints" / "mine"
    write_demo_model(model, seed=1)
    engine_port = _free_ports_in_a_row(2)
    with out.open("w") as stdout, err.open("a") as stderr:
        process = start_up(tmp_path, cp_port, engine_port, "--require-api-key", "--engines", "2", "--model",
                           str(model), "--served-model-name", "my-model", stdout=stdout, stderr=stderr,
                           router_port=router_port, env={"LORAPLANE_API_KEYS": "my-client-key"})
    try:
        wait_until_up(process, out, err)
        assert (state / "tenant-key").read_text().strip() == key  # still valid: reused
        assert "removed engine local " in out.read_text()
        assert "load demo-" not in out.read_text()  # no demo adapters on a user's checkpoint
        engines = httpx.get(cp + "/v1/engines", headers=auth, timeout=10).json()["data"]
        assert sorted(e["name"] for e in engines) == ["local-1", "local-2"]
        static = {"Authorization": "Bearer my-client-key"}  # LORAPLANE_API_KEYS reached the router
        assert "my-model" in [m["id"] for m in httpx.get(router + "/models", headers=static, timeout=10).json()["data"]]
        served = set()
        for i in range(12):  # distinct prompts: no prefix affinity, so both engines get some
            r = httpx.post(router + "/completions", headers=tenant if i % 2 else static, timeout=60,
                           json={"model": "my-model", "prompt": f"{i} hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-loraplane-engine"])
        assert served == {"local-1", "local-2"}
        # the two engines share this host's CPUs (control_plane/up.py): half each, no binding
        threads = str(max(1, len(available_cpus()) // 2))
        engine_pids = [p for p in descendants(process.pid) if role_of(p) == "engine"]
        assert len(engine_pids) == 2
        secret = (state / "engine-token").read_text().strip()
        tokens = {n: engine_admin_token(secret, n) for n in ("local-1", "local-2")}
        for pid in engine_pids:
            args = _cmdline(pid).split(b"\0")
            # each engine holds its own admin token only: never the secret, nor the other engine's
            name = args[args.index(b"--engine-name") + 1].decode()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            held = [t for t in (secret, *tokens.values()) if any(t.encode() in v for v in env)]
            assert held == [tokens[name]] and f"LORAPLANE_ADMIN_TOKEN={tokens[name]}".encode() in env
            assert args[args.index(b"--num-threads") + 1].decode() == threads
            assert args[args.index(b"--omp-threads-bind") + 1] == b"nobind"
            cores = [c for c in descendants(pid) if CORE_MODULE.encode() in _cmdline(c)]
            assert len(cores) == 1  # the engine-core process runs that many OpenMP threads
            assert f"OMP_NUM_THREADS={threads}".encode() in Path(f"/proc/{cores[0]}/environ").read_bytes().split(b"\0")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
    finally:
        stop_up(process)
    # the router's tenancy polls (every second) are routine: not at INFO; every text line names its process
    text = err.read_text().splitlines()
    assert not [line for line in text if " INFO " in line and "GET /v1/tenancy/" in line]
    assert {"control", "router", "engine[local-1]", "engine[local-2]"} <= {
        line.split()[2] for line in text if len(line.split()) > 2 and line.split()[1] == "INFO"}


def environ_of(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").replace("\0", "\n")
