from pathlib import Path

import pytest

from data_plane.demo.model_builder import write_demo_model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One seed-0 demo checkpoint shared by the read-only tests of this package."""
    out = tmp_path_factory.mktemp("demo_model")
    write_demo_model(out, seed=0)
    return out
