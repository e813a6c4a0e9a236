"""The agent warns when the engine it drives answers without an API key on an address other hosts reach
(anyone there could load and unload adapters), and is quiet on loopback or with a key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from data_plane.agent.config import AgentConfig
from data_plane.agent.runtime import AgentRuntime


@pytest.mark.parametrize(("engine_url", "api_key", "warned"), [
    ("http://10.1.2.3:8000", None, True),
    ("http://vllm.internal:8000", None, True),
    ("http://10.1.2.3:8000", "a-key", False),
    ("http://127.0.0.1:8000", None, False),
    ("http://[::1]:8000", None, False),
    ("http://localhost:8000", None, False),
])
def test_an_engine_open_to_other_hosts_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       engine_url: str, api_key: str | None, warned: bool) -> None:
    config = AgentConfig(engine_url=engine_url, control_plane_url="http://127.0.0.1:9", adapter_dir=str(tmp_path),
                         engine_api_key=api_key)
    runtime = AgentRuntime(config, "http://127.0.0.1:8001", "agent")
    with caplog.at_level(logging.WARNING, logger="data_plane.agent.runtime"):
        runtime._warn_if_open()  # what registration runs first
    said = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
    assert bool(said) == warned, said
    assert api_key is None or not any(api_key in r.getMessage() for r in caplog.records)
