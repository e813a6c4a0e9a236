"""tests/packaging/: fresh virtualenvs with one install of the package each (marker `packaging`)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "packaging: builds a virtualenv and installs the package into it (slow)")
