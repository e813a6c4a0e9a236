"""The control plane validates adapter folders with the torch-free shared.peft, as the engine reads them."""

from __future__ import annotations

import subprocess
import sys

from tests.data_plane.api.conftest import REPO_ROOT


def test_the_control_plane_imports_neither_the_engine_nor_torch() -> None:
    # the base install (control plane, router, CLI) has no torch: the PEFT format lives in shared/
    code = ("import sys, control_plane.app, control_plane.artifacts.inspect; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'data_plane', 'safetensors'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
