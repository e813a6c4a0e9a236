"""CPU threads of the engine-core process: torch's intra-op threads, OpenMP's wait policy, core binding.

The API process (HTTP, tokenizing, SSE), the clients on the same host and the core share the cores.
Chosen by measurement (bench/serving.py, 2 CPUs, 32 clients, the issue-13 model; figures in the
commit that set these defaults):

- OpenMP wait policy: left to libgomp (unset: a worker spins a short while after a parallel region,
  then sleeps). PASSIVE (sleep at once) made every step pay futex wake-ups: 0.76x in-process over
  HTTP at 2 threads against 0.97x unset. ACTIVE (spin forever) keeps an idle engine burning every
  core it has. The operator's OMP_WAIT_POLICY / GOMP_SPINCOUNT reach the core unchanged.
- torch threads: `num_threads` when given; else one per CPU below 4 CPUs (on 2 CPUs, 2 unbound
  threads served 1391 tok/s over HTTP against 994 for 1 thread bound beside the API), and one per
  CPU but one for the API process from 4 CPUs up (as vLLM reserves cores for its API server).
- `omp_threads_bind` (--omp-threads-bind, $LORAPLANE_CPU_OMP_THREADS_BIND, like vLLM's
  VLLM_CPU_OMP_THREADS_BIND): "auto" binds the core to the last `threads` CPUs it may run on when
  that leaves at least one for the API process, and does not bind otherwise; "nobind" never binds;
  a CPU list such as "1-3" or "2,3" binds the core to exactly those. When "auto" binds the core,
  `loraplane engine` keeps its API process on the other CPUs (api_cpus), so neither preempts the other.
  Several engines on one host: give each its own list (or nobind), or "auto" puts every core on the
  same last CPUs.
"""

from __future__ import annotations

import contextlib
import os

CPUS_ENV = "LORAPLANE_CORE_CPUS"  # the CPUs process.py binds the core to; process_main reads it before torch

RESERVE_API_CPU_FROM = 4  # CPUs from which the core leaves one to the API process by default


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """ "1-3,5" → [1, 2, 3, 5]; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        lo, hi = int(first), int(last) if sep else int(first)
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("empty CPU list")
    return sorted(cpus)


def check_bind(value: str) -> None:
    if value not in ("auto", "nobind"):
        parse_cpu_list(value)


def core_threads(num_threads: int | None, cpus: list[int]) -> int:
    """Torch intra-op threads of the core: as configured, else every CPU (but one for the API from 4 up)."""
    if num_threads:
        return num_threads
    return len(cpus) - 1 if len(cpus) >= RESERVE_API_CPU_FROM else max(1, len(cpus))


def core_cpus(bind: str, threads: int, cpus: list[int]) -> list[int] | None:
    """The CPUs to bind the core to (None: no binding)."""
    if bind == "nobind":
        return None
    if bind == "auto":
        return cpus[-threads:] if len(cpus) > threads else None
    return parse_cpu_list(bind)


def api_cpus(bind: str, core: list[int] | None, cpus: list[int]) -> list[int] | None:
    """The CPUs to keep the API process on (None: leave it): under "auto", those the core was not bound to,
    so that HTTP and tokenizing never preempt the core's threads on its own CPUs."""
    if bind != "auto" or core is None:
        return None
    rest = [c for c in cpus if c not in core]
    return rest or None


def bind_this_process(cpus: list[int]) -> None:
    """Every thread of this process (sched_setaffinity binds one thread; later threads inherit it)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def core_environment(base: dict[str, str], threads: int) -> dict[str, str]:
    """The core's environment: OpenMP's thread count unless the operator set it (its wait policy is
    libgomp's own unless the operator set OMP_WAIT_POLICY)."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env
