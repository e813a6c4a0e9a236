"""Entry point of an adapter reader process:
`python -m data_plane.adapters.loading.reader_process_main FD [--import-first]`.

FD: its end of a socket to the API process (reader_process.py). It lowers its priority first, or with
--import-first (an engine starting up) once it has imported what it needs. It says "ready" once torch and the
loader are imported; then each message is (AdapterReading, adapter path, hashes known of its files,
whether the engine has requests: the read is then paced, background.CpuPace) and each answer the
adapter's layout in a shared-memory file made for the API process
(transfer.SharedAdapter), or the exception the loader raised. It ends when the API process closes the socket or dies (end of file).
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

from data_plane.background import READER_BUSY_CPU_SHARE, READER_NICENESS, BackgroundPace, CpuPace


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    conn = Connection(int(argv[0]))
    import_first = "--import-first" in argv[1:]  # started with the engine, which serves nothing yet
    if not import_first:
        lower_priority()  # started while serving: even the torch import takes only the CPU the engine leaves

    import torch

    torch.set_num_threads(1)  # an adapter's few megabytes gain nothing from a second core (data_plane/background.py)
    import data_plane.adapters.loading.spec  # noqa: F401  (what each request's AdapterReading unpickles to)
    from data_plane.adapters.artifacts.verified_files import VerifiedFiles
    from data_plane.adapters.loading import shared_tensors
    from data_plane.adapters.loading.transfer import share_adapter

    shared_tensors.make_files_for(os.getppid())  # the API process owns what this one makes
    if import_first:
        lower_priority()  # ready: from now on it reads beside traffic
    try:
        conn.send("ready")
        while True:
            reading, path, known, busy = conn.recv()
            pace = CpuPace(BackgroundPace(lambda: True, READER_BUSY_CPU_SHARE)) if busy else None
            try:
                weights = reading.read(path, VerifiedFiles(known), pace)
            except Exception as exc:  # the loader's refusal (LoRAAdapterError), or its failure
                send_error(conn, path, exc)
                continue
            conn.send(share_adapter(weights))
            # the layout is on its way: the file is the API process's from now on, and this process's
            # mapping of it goes with `weights`
            weights.shared.hand_over()
            del weights
    except (EOFError, OSError):  # the API process closed the socket, or is gone
        return 0


def lower_priority() -> None:
    """Below the engine, at READER_NICENESS. Set, not added: the process starts at its parent thread's
    nice value, a reader thread's (data_plane/background.py) already."""
    os.setpriority(os.PRIO_PROCESS, 0, READER_NICENESS)


def send_error(conn: Connection, path: str, exc: Exception) -> None:
    """`exc` as the API process would have raised it, reading in its own thread."""
    try:
        conn.send(exc)
    except (TypeError, AttributeError, ValueError, RecursionError) as unpicklable:  # nothing was sent yet
        conn.send(RuntimeError(f"reading {path!r}: {type(exc).__name__}: {exc} ({unpicklable})"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
