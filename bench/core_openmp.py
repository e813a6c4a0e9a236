"""Imported first by a benchmark that sets the engine in its own process beside the engine core: this
process then runs OpenMP as the core does (data_plane/engine/core/threads.py: GOMP_SPINCOUNT), so that
the in-process figure and the served one differ only in serving. libgomp reads the setting once, when
torch loads it, so a process started without it executes itself again with it, before torch is imported.
"""

from __future__ import annotations

import os
import sys

from data_plane.engine.core.threads import openmp_spin

_env = openmp_spin(os.environ)
if _env != dict(os.environ):
    if "torch" in sys.modules:
        raise RuntimeError("import core_openmp before anything that imports torch")
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], _env)  # (orig_argv: -c and -m runs too)
