"""tests/tools.py: a tool that exists is found; a missing one skips the test, or fails it under
LORAPLANE_REQUIRE_TOOLS=1."""

from __future__ import annotations

import pytest

from tests.tools import require_tool

MISSING = "loraplane-no-such-tool"


def test_a_tool_on_the_path_is_found() -> None:
    assert require_tool("sh").endswith("/sh")


def test_a_missing_tool_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLANE_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install"):
        require_tool(MISSING)


def test_a_missing_tool_fails_when_tools_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="apt-get install"):
        require_tool(MISSING)
