"""Tools from Debian packages that some tests run (prometheus, promtool, chromium).

A developer's machine may lack them: the test is skipped, saying how to install the tool. CI sets
LORAPLANE_REQUIRE_TOOLS=1 (.ci/run installs the packages), and there a missing tool fails the test
instead, so that a broken install can never pass as a run of skips.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

PACKAGES = {"prometheus": "prometheus", "promtool": "prometheus", "chromium": "chromium"}  # tool -> package


def require_tool(name: str) -> str:
    """The path of the executable `name` (on PATH, or in /usr/bin where Debian puts it); skips the test when
    there is none, or fails it when LORAPLANE_REQUIRE_TOOLS=1."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if found is not None:
        return str(Path(found))
    how = f"apt-get update && apt-get install -y --no-install-recommends {PACKAGES.get(name, name)}"
    if os.environ.get("LORAPLANE_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{name} is required (LORAPLANE_REQUIRE_TOOLS=1) but not installed; install it: {how}")
    pytest.skip(f"{name} is not installed ({how})")
