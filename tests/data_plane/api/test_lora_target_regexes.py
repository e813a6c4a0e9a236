"""The regexes of an adapter's config at a real `loraplane engine --enable-lora`, which matches them against
every module name of its base model on load.

A target_modules regex with an alternative that makes a backtracking engine take time exponential in its
repetition count loads in time that does not grow with that count, and /health answers meanwhile; one
that RE2 cannot run is refused with a 400 naming the construct and the field.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from data_plane.api.app import create_app
from data_plane.demo.adapters import write_demo_adapters
from data_plane.lora.weights import TARGET_MODULES
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine
from tests.data_plane.api.engines import make_engine
from tests.liveness import polling_health, regex_matches_on_event_loop

# every projection, as demo-pirate targets them; then an alternative no module name matches, which a
# backtracking engine tries 2^n ways on every name of n characters or more
EVERY_PROJECTION = r"model\.layers\.\d+\.(?:self_attn|mlp)\.[a-z]+_proj"
BACKTRACKS = EVERY_PROJECTION + r"|(?:.|.){%d}Y"


@pytest.fixture(scope="module")
def served(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineServer, Path]]:
    """The engine and demo-pirate's folder under its adapter root."""
    tmp = tmp_path_factory.mktemp("target_regexes")
    pirate = write_demo_adapters(demo_model_dir, tmp / "root", names=["demo-pirate"])["demo-pirate"]
    with run_engine(demo_model_dir, tmp / "engine.log", "--enable-lora", "--lora-roots", str(tmp / "root"),
                    *SHARED_FLAGS) as server:
        yield server, pirate


def _copy(pirate: Path, **config: object) -> Path:
    """demo-pirate's weights under a config with `config`'s fields changed."""
    folder = shutil.copytree(pirate, pirate.parent / uuid.uuid4().hex[:12])
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _load(server: EngineServer, folder: Path, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.api + "/load_lora_adapter", json={"lora_name": folder.name, "lora_path": str(folder)},
                      timeout=timeout)


def _fastest_load(server: EngineServer, folder: Path, timeout: float, times: int = 2) -> float:
    """The fastest of `times` loads of `folder` (each unloaded again), /health answering throughout; inf
    when one times out."""
    best = float("inf")
    for _ in range(times):
        polled = polling_health(server.url, lambda: _load(server, folder, timeout))
        if polled.response is None:
            return float("inf")
        assert polled.response.status_code == 200, polled.response.text
        assert polled.response.json()["target_modules"] == list(TARGET_MODULES)
        assert polled.health and set(polled.health) == {200}, polled.health
        unloaded = httpx.post(server.api + "/unload_lora_adapter", json={"lora_name": folder.name}, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        best = min(best, polled.seconds)
    return best


def test_a_backtracking_target_regex_loads_in_time_independent_of_its_repetitions(served) -> None:
    server, pirate = served
    assert _load(server, pirate).status_code == 200  # the first load starts an adapter reader: not timed
    short = _fastest_load(server, _copy(pirate, target_modules=BACKTRACKS % 11), timeout=120)
    assert _fastest_load(server, _copy(pirate, target_modules=BACKTRACKS % 22), timeout=3 * short + 5) <= 3 * short


@pytest.mark.parametrize(("config", "named"), [
    ({"target_modules": r"(model)\.layers\.\d+\.self_attn\.q_proj|\1"}, "in target_modules of adapter_config.json "
                                                                        "uses a backreference"),
    ({"layers_to_transform": [0], "layers_pattern": r"lay(?=ers)ers"}, "in layers_pattern of adapter_config.json "
                                                                       "uses a lookahead or lookbehind"),
])
def test_a_regex_re2_cannot_run_is_refused_naming_it_and_the_field(served, config: dict, named: str) -> None:
    server, pirate = served
    r = _load(server, _copy(pirate, **config))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert named in error["message"] and "rewrite it, or list the module names instead" in error["message"]


def test_regexes_are_matched_off_the_event_loop(served, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the app itself, reading adapters on its own threads (no reader process): a load matches the
    config's regexes against every module name on a thread."""
    _, pirate = served
    engine = make_engine(demo_model_dir, enable_lora=True, lora_roots=[str(pirate.parent)],
                         adapter_reader_process=False)
    on_loop = regex_matches_on_event_loop(monkeypatch)
    with TestClient(create_app(engine, engine.config)) as client:
        folder = _copy(pirate, target_modules=BACKTRACKS % 11)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": folder.name, "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    assert on_loop and not any(on_loop), on_loop
