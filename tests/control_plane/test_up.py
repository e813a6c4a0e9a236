"""control_plane/up.py's share of the host's CPUs among the engines it starts (the whole stack runs in
tests/e2e/test_up.py, which checks that the flags reach the engines and their cores)."""

from __future__ import annotations

import pytest

from control_plane.up import _admin_token, _parser, engine_thread_flags, main

NOBIND = ["--omp-threads-bind", "nobind"]


@pytest.mark.parametrize(("engines", "device", "threads", "cpus", "flags"), [
    (1, "auto", None, 8, []),  # one engine takes every CPU (the engine's own default)
    (3, "cpu", None, 8, ["--num-threads", "2", *NOBIND]),  # 8 // 3
    (3, "cpu:0", None, 8, ["--num-threads", "2", *NOBIND]),
    (3, "auto", None, 2, ["--num-threads", "1", *NOBIND]),  # never below one
    (2, "cuda", None, 16, NOBIND),  # an accelerator's engines keep their thread count, not the shared binding
    (2, "npu", 4, 16, ["--num-threads", "4", *NOBIND]),  # asked for: given, on any device
    (1, "cpu", 3, 8, ["--num-threads", "3"]),  # one engine keeps its binding ("auto")
])
def test_engines_share_the_hosts_cpus(engines: int, device: str, threads: int | None, cpus: int,
                                      flags: list[str]) -> None:
    assert engine_thread_flags(engines, device, threads, cpus) == flags


@pytest.mark.parametrize("flag", ["--engines", "--engine-threads"])
def test_counts_below_one_are_refused_before_anything_starts(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _parser().parse_args([flag, "2"]) is not None
    assert main([flag, "0"]) == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(("tokens", "expected"), [("ops=token-one,token-two", "token-one"),
                                                  ("token-one,ops=token-two", "token-one")])
def test_up_calls_with_the_first_admin_tokens_token_named_or_not(tokens: str, expected: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKENS", tokens)
    assert _admin_token() == (expected, None)
