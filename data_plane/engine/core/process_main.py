"""Entry point of the engine-core process: `python -m data_plane.engine.core.process_main IN OUT PARENT_PID`.

Started by EngineCoreClient with OpenMP's settings in its environment (threads.py). Before torch is
imported it binds itself to the CPUs in $LORAPLANE_CORE_CPUS (if any); then it reads its Start
message, loads the model (spawning the other tensor-parallel ranks), answers Ready (or StartFailed)
and serves until Shutdown, SIGTERM, or its parent process going away, whichever comes first; on the
way out it shuts the other ranks down, so it leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from data_plane.engine.core.threads import CPUS_ENV  # torch-free: imported before the binding

PARENT_POLL_S = 0.5


def _bind_cpus() -> None:
    cpus = os.environ.get(CPUS_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """The API process died without a word (SIGKILL): stop, rather than serve nobody forever."""
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            stop.set()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    _bind_cpus()  # before torch starts its OpenMP threads: they inherit the mask
    in_addr, out_addr, parent_pid = argv[0], argv[1], int(argv[2])

    import zmq

    from data_plane.engine.core import messages as m

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)  # the last messages (Dead, the final outputs) still go out
    outbox.connect(out_addr)
    import msgspec

    from data_plane.engine.core.process import StartMessage

    config, log_level = msgspec.msgpack.decode(inbox.recv(), type=StartMessage)

    from shared.logging_setup import LOG_FORMAT_ENV, configure_logging

    configure_logging(log_level, os.environ.get(LOG_FORMAT_ENV, "text"))
    from data_plane.engine.core.engine_core import EngineCore
    from data_plane.engine.llm_engine import LLMEngine
    from shared.errors import LoraplaneError

    try:
        engine = LLMEngine.from_config(config)
    except LoraplaneError as exc:
        outbox.send(m.encoder.encode(m.StartFailed(m.WireError.of(exc))))
        inbox.close(linger=0)
        outbox.close()  # lingers until the message is out
        ctx.term()
        return 2
    core = EngineCore(engine, inbox, outbox)
    signal.signal(signal.SIGTERM, lambda *_: core.stop.set())
    threading.Thread(target=_watch_parent, args=(parent_pid, core.stop), daemon=True, name="parent-watch").start()
    outbox.send(m.encoder.encode(m.Ready(config, engine.vocab_size, engine.stats())))
    code = core.run()
    try:
        engine.shutdown()  # the other tensor-parallel ranks
    finally:
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
