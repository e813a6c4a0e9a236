"""control_plane/up.py's share of the host's CPUs among the engines it starts (the whole stack runs in
tests/e2e/test_up.py, which checks the flags reach the engines and their cores)."""

from __future__ import annotations

import pytest

from control_plane.up import _parser, engine_thread_flags, main


@pytest.mark.parametrize(("engines", "device", "threads", "cpus", "flags"), [
    (1, "auto", None, 8, []),  # one engine takes every CPU (the engine's own default)
    (3, "cpu", None, 8, ["--num-threads", "2", "--omp-threads-bind", "nobind"]),  # 8 // 3
    (3, "auto", None, 2, ["--num-threads", "1", "--omp-threads-bind", "nobind"]),  # never below one
    (2, "cuda", None, 16, []),  # an accelerator's engines keep their default
    (2, "cuda", 4, 16, ["--num-threads", "4", "--omp-threads-bind", "nobind"]),  # asked for: given
    (1, "cpu", 3, 8, ["--num-threads", "3"]),  # one engine keeps its binding ("auto")
])
def test_engines_share_the_hosts_cpus(engines: int, device: str, threads: int | None, cpus: int,
                                      flags: list[str]) -> None:
    assert engine_thread_flags(engines, device, threads, cpus) == flags


def test_engine_threads_is_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parser().parse_args(["--engine-threads", "2"]).engine_threads == 2
    assert main(["--engine-threads", "0"]) == 2
    assert "--engine-threads must be at least 1" in capsys.readouterr().err
