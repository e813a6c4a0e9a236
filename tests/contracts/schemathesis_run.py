"""One schemathesis run against a live app's OpenAPI document, as every contract test runs it: every
check, every phase, a time budget, the configuration file of that app (its exclusions with reasons)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.data_plane.api.conftest import REPO_ROOT


def run_schemathesis(base_url: str, config: Path, env: dict[str, str], max_time_s: int) -> subprocess.CompletedProcess:
    """`st run` over `base_url`'s /schema/openapi.json; PYTHONPATH is the repository (hooks modules)."""
    cmd = [
        str(Path(sys.executable).with_name("st")), "--config-file", str(config), "--no-color", "run",
        f"{base_url}/schema/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-time", str(max_time_s),
        # a completion of max_tokens on 2 busy cores may take over the default 10 s; as long as the
        # request timeout, so a hang still fails
        "--max-response-time", "30",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                          text=True, timeout=max_time_s + 120)
