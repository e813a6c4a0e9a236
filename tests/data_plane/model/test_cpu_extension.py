"""Both compiled CPU kernels (the LoRA BGMV ops, the decode attention) fall back with a warning naming
what serves instead when no compiler is found or the build fails."""

from __future__ import annotations

import logging

import pytest

from data_plane.lora.kernels.cpu import load_cpu_kernels
from data_plane.model.attention_kernels import load_cpu_decode_attention

LOADERS = {  # loader, its module's logger, what the warning says serves instead
    "lora": (load_cpu_kernels, "data_plane.lora.kernels.cpu", "pure-torch LoRA ops"),
    "attention": (load_cpu_decode_attention, "data_plane.model.attention_kernels", "gather + SDPA"),
}


@pytest.mark.parametrize("name", LOADERS)
def test_no_compiler_or_a_failing_build_falls_back_with_a_warning(name, monkeypatch, tmp_path, caplog):
    loader, logger_name, fallback = LOADERS[name]
    build = loader.__wrapped__  # uncached: the real build steps, with what the environment says
    monkeypatch.setenv("LORAPLANE_KERNEL_BUILD_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=logger_name):
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        assert build() is None
        assert "no-such-compiler" in caplog.text and fallback in caplog.text
        caplog.clear()
        monkeypatch.setenv("CXX", "false")  # a compiler that fails every file
        assert build() is None
        assert "failed to build" in caplog.text and str(tmp_path) in caplog.text
