"""The stack as `make run` starts it, in a folder of its own: the command of the Makefile's `run` recipe
(`make -n run`, with REQUIRE_API_KEY=1 for tenancy: up then starts its own redis-server) on free ports,
with `.venv` a link to the virtualenv running the tests, so that `.venv/bin/…` in the pages is this
checkout's code, and its state under the folder's fresh `.loraplane/`.

Two caches are shared with the rest of the suite, not state a page can see: the compiled CPU kernels
(LORAPLANE_KERNEL_BUILD_DIR, the repository's `.loraplane/build` where the suite's engines build them)
and the demo model, which the first walk writes and the next one gets as a copy of `.demo/`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.docs_walk.ports import Ports
from tests.e2e.test_control_plane_engines import _free_port
from tests.e2e.test_up import KERNEL_BUILD, stop_up, wait_until_up

REPO = Path(__file__).resolve().parents[2]


def walker_env(folder: Path) -> dict[str, str]:
    """The environment of a reader's terminal in `folder`: none of the caller's LORAPLANE_* or OPENAI_*
    settings, no profile file of the caller's, the checkout's code first on the import path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORAPLANE_", "OPENAI_")) and k not in ("OMP_NUM_THREADS", "VIRTUAL_ENV")}
    return {**env, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(folder / ".config"), "PYTHONUNBUFFERED": "1"}


def make_run_command(ports: Ports, require_api_key: bool) -> list[str]:
    """What `make run` runs once its virtualenv is installed (`STAMP=` leaves the install out)."""
    variables = {"STAMP": "", "PORT": ports.router, "CONTROL_PORT": ports.control, "ENGINE_PORT": ports.engine,
                 "REQUIRE_API_KEY": "1" if require_api_key else ""}
    printed = subprocess.run(["make", "-s", "-n", "-f", str(REPO / "Makefile"), "run",
                              *(f"{k}={v}" for k, v in variables.items())],
                             capture_output=True, text=True, check=True).stdout
    return shlex.split(printed.replace("\\\n", " "))


@contextlib.contextmanager
def make_run(folder: Path, demo_cache: Path, require_api_key: bool) -> Iterator[Ports]:
    """`make run` (REQUIRE_API_KEY=1 when `require_api_key`) in `folder`, until the block ends."""
    (folder / ".venv").symlink_to(Path(sys.prefix))
    if (demo_cache / "model").exists():
        shutil.copytree(demo_cache, folder / ".demo")
    ports = Ports(router=_free_port(), control=_free_port(), engine=_free_port())
    cmd = make_run_command(ports, require_api_key)
    env = {**walker_env(folder), **KERNEL_BUILD}
    out, err = folder / "up.out", folder / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(cmd, cwd=folder, stdout=stdout, stderr=stderr, env=env)
    try:
        wait_until_up(process, out, err)
        if not (demo_cache / "model").exists():
            shutil.copytree(folder / ".demo", demo_cache, dirs_exist_ok=True)
        yield ports
    finally:
        stop_up(process)
