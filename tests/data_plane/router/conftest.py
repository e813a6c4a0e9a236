"""Real engines for the router's proxy tests: the demo model with its demo adapters loaded at start."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from data_plane.demo.adapters import write_demo_adapters
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine


@pytest.fixture(scope="session")
def demo_adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_demo_adapters(demo_model_dir, tmp_path_factory.mktemp("router_adapters"))


def lora_flags(adapters: dict[str, Path]) -> tuple[str, ...]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return ("--enable-lora", "--lora-modules", *modules, *SHARED_FLAGS)


@pytest.fixture(scope="module")
def lora_engine(demo_model_dir: Path, demo_adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    """One engine for a test module: `demo` and the demo adapters, no keys."""
    log = tmp_path_factory.mktemp("router_engine") / "engine.log"
    with run_engine(demo_model_dir, log, *lora_flags(demo_adapters)) as server:
        yield server


@pytest.fixture
def start_lora_engine(demo_model_dir: Path, demo_adapters: dict[str, Path],
                      tmp_path: Path) -> Iterator[Callable[..., EngineServer]]:
    """A dedicated engine (its own metrics, or flags such as --api-key), stopped at the end of the test."""
    numbers = itertools.count()
    with contextlib.ExitStack() as stack:

        def start(*flags: str, env: dict[str, str] | None = None) -> EngineServer:
            log = tmp_path / f"engine-{next(numbers)}.log"
            return stack.enter_context(run_engine(demo_model_dir, log, *lora_flags(demo_adapters), *flags, env=env))

        yield start
