"""CPU threads of the engine-core process: torch's intra-op threads, OpenMP's wait policy, core binding.

The API process (HTTP, tokenizing, SSE), the clients on the same host and the core share the cores.
Why these defaults: see docs/performance.md#engine-threads-and-openmp (measure with bench/serving.py
for one engine, bench/fleet.py for several on one host).

- OpenMP wait policy: libgomp's own (a worker spins a while after a parallel region, then sleeps),
  with the spin shortened to CORE_SPIN_COUNT (GOMP_SPINCOUNT; libgomp's default is 300,000): with
  several engines on one host, the workers of a core between steps (or idle) would spin on CPUs that
  the other engines need. PASSIVE (sleep at once) makes every step pay futex wake-ups; ACTIVE (spin
  forever) keeps an idle engine burning every core it has. An operator who sets OMP_WAIT_POLICY or
  GOMP_SPINCOUNT gets exactly that.
- torch threads: `num_threads` when given; else one per CPU below 4 CPUs (unbound threads on every CPU
  serve more than fewer threads bound beside the API), and one per CPU but one for the API process
  from 4 CPUs up (as vLLM reserves cores for its API server).
- `omp_threads_bind` (--omp-threads-bind, $LORAPLANE_CPU_OMP_THREADS_BIND, like vLLM's
  VLLM_CPU_OMP_THREADS_BIND): "auto" binds the core to the last `threads` CPUs it may run on when
  that leaves at least one for the API process, and does not bind otherwise; "nobind" never binds;
  a CPU list such as "1-3" or "2,3" binds the core to exactly those. When "auto" binds the core,
  `loraplane engine` keeps its API process on the other CPUs (api_cpus), so neither preempts the other.
  Several engines on one host: give each its own list (or nobind), or "auto" puts every core on the
  same last CPUs. An engine whose "auto" lands on CPUs another engine core is bound to says so in a
  warning at start (`bound_engine_cores`), as nothing else would show it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

CPUS_ENV = "LORAPLANE_CORE_CPUS"  # the CPUs process.py binds the core to; process_main reads it before torch
CORE_MODULE = "data_plane.engine.core.process_main"  # how an engine core shows in a process list

RESERVE_API_CPU_FROM = 4  # CPUs from which the core leaves one to the API process by default
CORE_SPIN_COUNT = "3000"  # GOMP_SPINCOUNT: how long an OpenMP worker spins before it sleeps (module docstring)


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


def bound_engine_cores(cpus: list[int]) -> dict[int, set[int]]:
    """pid -> CPUs of every engine core on this host (other than this process) bound to fewer CPUs than
    `cpus`, the ones this process may use: those that --omp-threads-bind pinned."""
    found: dict[int, set[int]] = {}
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc"):
        return found  # not Linux: nothing binds cores there
    every = set(cpus)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to look at
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if CORE_MODULE.encode() not in f.read():
                    continue
            affinity = os.sched_getaffinity(int(entry.name))
            if not affinity >= every:
                found[int(entry.name)] = affinity
    return found


def bind_this_process(cpus: list[int]) -> None:
    """Every thread of this process (sched_setaffinity binds one thread; later threads inherit it)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def core_environment(base: dict[str, str], threads: int) -> dict[str, str]:
    """The core's environment: OpenMP's thread count unless the operator set it, and its spin
    (openmp_spin) unless the operator chose a wait policy."""
    env = openmp_spin(base)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def openmp_spin(base: Mapping[str, str]) -> dict[str, str]:
    """`base` with GOMP_SPINCOUNT = CORE_SPIN_COUNT, unless it sets OMP_WAIT_POLICY or GOMP_SPINCOUNT. libgomp
    reads it once, when torch loads it: a process's environment before it imports torch."""
    env = dict(base)
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", CORE_SPIN_COUNT)
    return env
