"""How `make test` spreads the suite over processes (pytest-xdist, `-n 2 --dist loadfile`).

Each test module is one unit of work, run on one worker in file order: its module-scoped fixtures (an
engine, a control plane, a fleet) start once, and some modules' tests build on what the ones before them
left. tests/faults/ is one unit as a whole: its tests share a package-scoped fleet and run in file order
across its files (tests/faults/conftest.py). The modules against a real vLLM are one unit too, so that
two vLLM servers never compete for the CPUs at once. The units that take longest (LONGEST_FIRST) are
handed out first, so that the many short modules fill the workers' time at the end instead of one long
unit running alone there. Without xdist, or with another --dist, nothing changes here.

(xdist's own `--dist loadgroup` marks cannot say this under pytest 9.2: it renames items through an
attribute pytest no longer reads, so every test becomes a unit of its own and tests/faults/ is split.)
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator

import pytest

# node-id prefixes that make one unit each, whatever the module (node ids are relative to the root)
ONE_UNIT = ("tests/faults/", "tests/e2e/test_vllm_")
# the units that take longest, longest first (a run's per-module times: --junitxml or --durations=0); the
# rest follow in xdist's order (most tests first)
LONGEST_FIRST = (
    "tests/e2e/test_vllm_",
    "tests/control_plane/domain/placements/test_fleet.py",
    "tests/data_plane/router/test_proxy.py",
    "tests/faults/",
    "tests/data_plane/engine/test_tensor_parallel.py",
    "tests/e2e/test_up.py",
    "tests/docs_walk/test_docs_walk.py",
    "tests/control_plane/domain/adapters/test_load.py",
    "tests/contracts/test_engine_contract.py",
    "tests/data_plane/adapters/loading/test_reader_process.py",
    "tests/contracts/test_router_contract.py",
    "tests/e2e/test_router.py",
    "tests/data_plane/model/test_attention_kernels.py",
    "tests/control_plane/domain/engines/test_engine_role.py",
)

if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        """--dist loadfile, with each of ONE_UNIT one unit and the LONGEST_FIRST units handed out first."""

        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return next((p for p in ONE_UNIT if module.startswith(p)), module)

        def _assign_work_unit(self, node: object) -> None:
            if not self._ordered:  # the queue is complete before its first unit is handed out
                for scope in reversed([s for s in LONGEST_FIRST if s in self.workqueue]):
                    self.workqueue.move_to_end(scope, last=False)
                self._ordered = True
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadFileScheduling | None:
        return ModuleScheduling(config, log) if config.getvalue("dist") == "loadfile" else None  # type: ignore[arg-type]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Engines that tests kill outright (SIGKILL) leave their adapters' shared-memory files behind, for the
    next engine's start to sweep (data_plane/adapters/loading/shared_tensors.py); the end of the run sweeps
    them too, so that none outlives the suite on the machine."""
    if importlib.util.find_spec("torch") is None:  # nothing of the engine can have run
        return
    from data_plane.adapters.loading.shared_tensors import sweep_orphans

    sweep_orphans()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """For a test that configures logging in this process (shared/logging_setup.py, as the CLIs do): the
    root logger's handlers and level are put back afterwards. Left in place, a handler holds the stream
    the test had as stderr (capsys' buffer, closed when the test ends), and every later test's log line
    in this process printed a "--- Logging error ---" traceback instead."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
