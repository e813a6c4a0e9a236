"""The regexes of an adapter's config (target_modules and the like) at a real `loraplane control` process.

A regex that makes a backtracking engine take time exponential in the module name (a run of zeros in a
tensor's layer index) is matched in time linear in it, and /health answers meanwhile; one that RE2 cannot
run is refused with a 400 naming the construct and the field.
"""

from __future__ import annotations

import json
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient

from tests.control_plane.conftest import admin
from tests.e2e.test_control_plane_engines import ADMIN, control_plane
from tests.liveness import polling_health, regex_matches_on_event_loop

# `(?:0|0)*` may take each zero two ways: a backtracking engine tries 2^n ways before the final X fails
BACKTRACKS = r"model\.layers\.(?:0|0)*1\.self_attn\.q_projX"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The control plane's URL and its adapter root."""
    tmp = tmp_path_factory.mktemp("target_regexes")
    root = tmp / "adapters"
    root.mkdir()
    with control_plane(tmp, root) as url:
        yield url, root


def _adapter(root: Path, config: dict, module: str = "model.layers.0.self_attn.q_proj") -> Path:
    """A LoRA folder of rank 4 for `module` (its header: the tensors' data is not read here)."""
    folder = root / uuid.uuid4().hex[:12]
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    key = f"base_model.model.{module}.lora_"
    header = json.dumps({key + "A.weight": {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]},
                         key + "B.weight": {"dtype": "F32", "shape": [64, 4], "data_offsets": [1024, 2048]}}).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2048))
    return folder


def _zeros(root: Path, digits: int) -> Path:
    """BACKTRACKS against a layer index of `digits` digits, all zeros but the last."""
    return _adapter(root, {"target_modules": BACKTRACKS}, f"model.layers.{'0' * (digits - 1)}1.self_attn.q_proj")


def _load(url: str, folder: Path, timeout: float = 120) -> httpx.Response:
    body = {"lora_name": f"regex-{folder.name}", "lora_path": str(folder), "base_model": "demo"}
    return httpx.post(url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=timeout)


def test_health_answers_while_a_backtracking_regex_is_matched(served: tuple[str, Path]) -> None:
    url, root = served
    folder = _zeros(root, 28)
    polled = polling_health(url, lambda: _load(url, folder))
    assert polled.response is not None and polled.response.status_code == 400, polled
    assert "is for a module adapter_config.json does not target" in polled.response.json()["error"]["message"]
    assert polled.health and set(polled.health) == {200}, polled.health


def _fastest(url: str, folder: Path, timeout: float, times: int = 3) -> float:
    """The fastest of `times` loads of `folder` (each a 400: its module is not targeted); inf on a timeout."""
    best = float("inf")
    for _ in range(times):
        polled = polling_health(url, lambda: _load(url, folder, timeout))
        if polled.response is None:
            return float("inf")
        assert polled.response.status_code == 400, polled.response.text
        best = min(best, polled.seconds)
    return best


def test_matching_takes_time_linear_in_the_module_name(served: tuple[str, Path]) -> None:
    url, root = served
    short = _fastest(url, _zeros(root, 26), timeout=120)
    assert _fastest(url, _zeros(root, 52), timeout=3 * short + 5) <= 3 * short


@pytest.mark.parametrize(("config", "cause"), [
    ({"target_modules": ["q_proj"]}, "names a layer index of 5000 digits; no model has that many layers"),
    ({"target_modules": ["q_proj"], "layers_to_transform": [1]}, "is for a module adapter_config.json does not target"),
])
def test_a_layer_index_of_thousands_of_digits_is_refused(served: tuple[str, Path], config: dict, cause: str) -> None:
    url, root = served
    r = _load(url, _adapter(root, config, f"model.layers.{'1' * 5000}.self_attn.q_proj"))
    assert r.status_code == 400, r.text
    assert cause in r.json()["error"]["message"]


@pytest.mark.parametrize(("config", "named"), [
    ({"target_modules": r"(model)\.layers\.0\.self_attn\.q_proj\1"}, "in target_modules of adapter_config.json "
                                                                     "uses a backreference"),
    ({"target_modules": ["q_proj"], "exclude_modules": r"(?!model).*"}, "in exclude_modules of adapter_config.json "
                                                                        "uses a negative lookahead"),
    ({"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": r"(?<=model\.)layers"},
     "in layers_pattern of adapter_config.json uses a lookahead or lookbehind"),
    ({"target_modules": ["q_proj"], "rank_pattern": {r"(?>q)_proj": 4}}, "in rank_pattern of adapter_config.json "
                                                                         "uses an atomic group"),
    ({"target_modules": ["q_proj"], "alpha_pattern": {r"q_proj*+": 4}}, "in alpha_pattern of adapter_config.json "
                                                                        "uses a possessive quantifier"),
])
def test_a_regex_re2_cannot_run_is_refused_naming_it_and_the_field(served: tuple[str, Path], config: dict,
                                                                   named: str) -> None:
    url, root = served
    r = _load(url, _adapter(root, config))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert named in error["message"] and "rewrite it, or list the module names instead" in error["message"]


async def test_regexes_are_matched_off_the_event_loop(client: AsyncTestClient, demo: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In the app itself: a load from a folder and an upload both match the config's regexes on a thread."""
    folder = shutil.copytree(demo["demo-pirate"], demo["root"] / f"regex-{uuid.uuid4().hex[:12]}")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.[a-z]+_proj"}))
    on_loop = regex_matches_on_event_loop(monkeypatch)
    body = {"lora_name": "regex-folder", "lora_path": str(folder), "base_model": "demo"}
    assert (await client.post("/v1/load_lora_adapter", json=body, headers=admin())).status_code == 200
    files = [("files", (name, (folder / name).read_bytes())) for name in ("adapter_config.json",
                                                                           "adapter_model.safetensors")]
    r = await client.post("/v1/lora_adapters/regex-upload/versions", files=files, data={"base_model": "demo"},
                          headers=admin())
    assert r.status_code in (200, 201), r.text
    assert on_loop and not any(on_loop), on_loop
