"""CoreProcess: start the engine-core process, send it its config, hold this side's two sockets to it.

Kept free of torch and of the engine's modules, so that `loraplane engine` can start the core first
and import the API while the core imports torch and loads the model.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import zmq

from data_plane.config import EngineConfig
from data_plane.engine.core.threads import (
    CORE_MODULE,
    CPUS_ENV,
    bound_engine_cores,
    core_cpus,
    core_environment,
    core_threads,
)
from shared.cpus import available_cpus
from shared.secret_env import without_secrets

logger = logging.getLogger(__name__)
StartMessage = tuple[EngineConfig, str]  # (config, log level): the first message, before the engine's wire types
SECRETS = ("admin_token", "read_token", "api_key", "control_plane_token")  # config fields the core needs none of


@dataclass
class CoreProcess:
    """The started core process and this side's two sockets to it."""

    config: EngineConfig  # what the core runs with (core_config)
    process: subprocess.Popen[bytes]
    cpus: list[int] | None  # what the core is bound to (None: not bound)
    context: zmq.Context[zmq.Socket[bytes]]
    to_core: zmq.Socket[bytes]  # PUSH
    from_core: zmq.Socket[bytes]  # PULL
    ipc_dir: str

    @classmethod
    def spawn(cls, config: EngineConfig) -> CoreProcess:
        """Start the core for `config` (the API's); it loads the model once it gets its Start message."""
        config = core_config(config)
        ipc_dir = tempfile.mkdtemp(prefix="loraplane-core-")
        context = zmq.Context()
        to_core, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        to_core.setsockopt(zmq.SNDHWM, 0)  # never block a send: a dead core is noticed by its exit instead
        from_core.setsockopt(zmq.RCVHWM, 0)
        to_core.bind(f"ipc://{ipc_dir}/in")
        from_core.bind(f"ipc://{ipc_dir}/out")
        cpus = available_cpus()
        env = core_environment(without_secrets(os.environ), config.num_threads or 1)
        bind = core_cpus(config.omp_threads_bind, config.num_threads or 1, cpus)
        if bind is not None:
            env[CPUS_ENV] = ",".join(map(str, bind))
            if config.omp_threads_bind == "auto":
                warn_if_cores_share(bind, cpus)
        args = [f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out", str(os.getpid())]
        process = subprocess.Popen([sys.executable, "-m", CORE_MODULE, *args], env=env)
        logger.info("engine core: process %d, %s torch threads, CPUs %s", process.pid,
                    config.num_threads or "default", bind if bind is not None else "unbound")
        atexit.register(_kill, process)  # however the API process ends, the core goes with it
        # the Start message: the core loads the model on it, while this process goes on importing the API
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        to_core.send(msgspec.msgpack.encode((config, log_level)))
        return cls(config, process, bind, context, to_core, from_core, ipc_dir)

    def kill(self) -> None:
        _kill(self.process)

    def close(self) -> None:
        self.to_core.close(linger=0)
        self.from_core.close(linger=0)
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        # (the adapters' shared files are not the core's: each goes with the weights owning it, see
        # data_plane/adapters/loading/shared_tensors.py)


def warn_if_cores_share(bind: list[int], cpus: list[int]) -> str | None:
    """"auto" picked the same last CPUs for every engine on a host: say so when another core has them;
    answers the warning logged (None: none)."""
    sharing = {pid: sorted(c) for pid, c in bound_engine_cores(cpus).items() if c & set(bind)}
    if not sharing:
        return None
    message = (
        f"--omp-threads-bind auto binds this engine's core to CPUs {bind}, and other engine cores on this host "
        f"are bound to some of them (pid: CPUs {sharing}), so they take turns on those CPUs while others may "
        "idle. With several engines on one host, give each its own --omp-threads-bind CPU list, or nobind, and "
        "--num-threads so that their threads add up to the host's CPUs (`loraplane up --engines N` does this).")
    logger.warning(message)
    return message


def core_config(config: EngineConfig) -> EngineConfig:
    """What the core runs with: the threads chosen for it, and no secrets."""
    threads = config.num_threads
    if threads is None and config.tensor_parallel_size == 1:  # TP ranks split the CPUs themselves
        threads = core_threads(None, available_cpus())
    # Any: replace() takes each field's own type, and every secret field is `str | None`
    no_secrets: dict[str, Any] = dict.fromkeys(SECRETS)
    return replace(config, num_threads=threads, **no_secrets)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
