"""End to end over loopback: adapters live in the control plane's artifact store, not on any engine's disk.

A real `loraplane control` with `--artifact-store` and two real engines whose `--lora-cache-dir` are their
own and whose `--lora-roots` is an empty folder (neither the store nor the upload's source lies under it):
an adapter uploaded as multipart from a folder nobody else reads is served by both with PEFT's greedy
tokens; an engine restarted on its cache dir serves it again without one more artifact request at the
control plane (its /metrics counter is the proof) and counts a cache hit. Then the same on an S3 store,
moto's real S3 API server on loopback: the engines fetch the files from presigned URLs at moto, so no
file byte passes through the control plane. Without moto the S3 test skips, unless CI is set.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.control_plane.artifacts.conftest import require_moto
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine, scrape_metric
from tests.data_plane.api.test_lora_artifacts import chat, peft_tokens
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    control_plane,
    engine_auth,
    engine_token,
    started,
    wait_for,
)
from tests.e2e.test_control_plane_engines import _free_port as free_port

FILE_ROUTE, MANIFEST_ROUTE = 'route="/v1/artifacts/{digest}/{name}"', 'route="/v1/artifacts/{digest}"'
MOTO_KEYS = {"AWS_ACCESS_KEY_ID": "e2e-access-key", "AWS_SECRET_ACCESS_KEY": "e2e-secret-key",
             "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the base model, an adapter folder that lies outside every engine's and the control plane's roots)."""
    tmp = tmp_path_factory.mktemp("artifacts_e2e")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    return base, write_demo_adapters(base, tmp / "uploads", names=["demo-poet"])["demo-poet"]


def requests_at(cp: str, route: str) -> float:
    """loraplane_control_requests_total of one route (0 before its first request: no series yet)."""
    try:
        return scrape_metric(cp, "loraplane_control_requests_total", route)
    except KeyError:
        return 0.0


def upload(cp: str, name: str, folder: Path) -> httpx.Response:
    files = {n: (n, (folder / n).read_bytes(), "application/octet-stream") for n in (CONFIG_NAME, WEIGHTS_NAME)}
    return httpx.post(f"{cp}/v1/lora_adapters/{name}/versions", files=files,
                      # both engines hold it (a load goes to `min` engines)
                      data={"base_model": "demo", "replicas": '{"min": 2, "max": 2}'},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)


def empty_root(tmp: Path) -> Path:
    """The --lora-roots of every process here: a folder with nothing in it."""
    root = tmp / "empty-root"
    root.mkdir(exist_ok=True)
    return root


def start_engines(stack: contextlib.ExitStack, base: Path, cp: str, tmp: Path, *extra: str,
                  names: tuple[str, ...] = ("e1", "e2")) -> dict[str, EngineServer]:
    """Engines `names` (started side by side: each start takes seconds) with their own cache dir under tmp
    and an empty --lora-roots; each holds only its own engine token of the control plane."""

    def start(name: str) -> EngineServer:
        flags = ("--enable-lora", "--lora-roots", str(empty_root(tmp)), "--lora-cache-dir", str(tmp / f"cache-{name}"),
                 "--admin-token", engine_token(name), "--control-plane", cp, "--engine-name", name, *extra, *SHARED_FLAGS)
        env = {"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS[name]}
        return stack.enter_context(run_engine(base, tmp / f"{name}-{time.monotonic_ns()}.log", *flags, env=env))

    with ThreadPoolExecutor(len(names)) as pool:
        engines = dict(zip(names, pool.map(start, names), strict=True))
    reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)

    def healthy() -> bool:
        states = {e["name"]: e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]}
        return all(states.get(name) == "healthy" for name in names)

    wait_for(healthy, "the engines to register")
    return engines


def serves(engine: EngineServer, engine_name: str, name: str) -> bool:
    listed = httpx.get(engine.api + "/lora_adapters", timeout=10, headers=engine_auth(engine_name)).json()["adapters"]
    return any(a["name"] == name and a["state"] == "ready" for a in listed)


def assert_peft_tokens(engines: dict[str, EngineServer], base: Path, adapter: Path, model: str) -> list[int]:
    """Each engine's greedy tokens for `model` equal PEFT's on the same prompt (and differ from the base's)."""
    answers = {n: chat(httpx.Client(base_url=e.url, timeout=60), model).json() for n, e in engines.items()}
    first = next(iter(answers.values()))
    expected = peft_tokens(base, adapter, first["prompt_token_ids"])
    assert {n: a["choices"][0]["token_ids"] for n, a in answers.items()} == dict.fromkeys(engines, expected)
    base_answer = chat(httpx.Client(base_url=first_engine(engines).url, timeout=60), "demo").json()
    assert base_answer["choices"][0]["token_ids"] != expected
    return expected


def first_engine(engines: dict[str, EngineServer]) -> EngineServer:
    return next(iter(engines.values()))


def test_an_upload_is_served_by_engines_that_cannot_read_it(demo, tmp_path: Path) -> None:
    base, adapter = demo
    store = tmp_path / "store"
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp_path, empty_root(tmp_path),
                                               flags=("--artifact-store", store.as_uri())))
        engines = start_engines(stack, base, cp, tmp_path)
        r = upload(cp, "poet", adapter)
        assert r.status_code == 200, r.text
        assert [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [("e1", "loaded"), ("e2", "loaded")]
        digest = r.json()["sha256"]
        assert len(list((store / "blobs").iterdir())) == 2  # the version's two files are in the store…
        for name in engines:  # …and each engine verified its own copy into its own cache
            cached = tmp_path / f"cache-{name}" / digest
            # the cache's copy is written in the background while the load parses the verified bytes
            wait_for(lambda cached=cached: (cached / ".manifest.json").exists(), f"{name} to write its cache copy")
            assert (cached / WEIGHTS_NAME).read_bytes() == (adapter / WEIGHTS_NAME).read_bytes()
        expected = assert_peft_tokens(engines, base, adapter, "poet")
        assert requests_at(cp, FILE_ROUTE) == 4  # two files for each engine

        # e2 dies (SIGKILL: a SIGTERM drains it, and a drained engine gets no placements) and comes back on
        # its cache dir → the reconciler loads the adapter again, from the cache, with no artifact request
        fetched_files, fetched_manifests = requests_at(cp, FILE_ROUTE), requests_at(cp, MANIFEST_ROUTE)
        engines["e2"].process.kill()
        engines["e2"].process.wait(timeout=30)
        e2 = start_engines(stack, base, cp, tmp_path, names=("e2",))["e2"]
        wait_for(lambda: serves(e2, "e2", "poet"), "the reconciler to load poet on the restarted e2")
        answer = chat(httpx.Client(base_url=e2.url, timeout=60), "poet").json()
        assert answer["choices"][0]["token_ids"] == expected
        assert (requests_at(cp, FILE_ROUTE), requests_at(cp, MANIFEST_ROUTE)) == (fetched_files, fetched_manifests)
        assert e2.metric("loraplane_artifact_cache_hits_total") >= 1
        assert e2.metric("loraplane_artifact_cache_misses_total") == 0
        assert e2.metric("loraplane_artifact_fetch_bytes_total") == 0


@contextlib.contextmanager
def moto_server(tmp: Path, bucket: str) -> Iterator[str]:
    """moto's S3 API server on a loopback port, with `bucket` created; its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with started(cmd, tmp / "moto.log", {**os.environ, **MOTO_KEYS},
                 lambda: httpx.put(f"{endpoint}/{bucket}", timeout=2).status_code == 200, "moto"):
        yield endpoint

def test_an_upload_to_an_s3_store_is_fetched_from_presigned_urls(demo, tmp_path: Path) -> None:
    require_moto()
    base, adapter = demo
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(moto_server(tmp_path, "adapters"))
        cp = stack.enter_context(control_plane(tmp_path, empty_root(tmp_path),
                                               flags=("--artifact-store", "s3://adapters/fleet"),
                                               AWS_ENDPOINT_URL=s3, **MOTO_KEYS))
        engines = start_engines(stack, base, cp, tmp_path, "--lora-artifact-endpoint", s3)
        r = upload(cp, "poet", adapter)
        assert r.status_code == 200, r.text
        assert [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [("e1", "loaded"), ("e2", "loaded")]
        listing = httpx.get(f"{s3}/adapters", params={"list-type": "2", "prefix": "fleet/blobs/"}, timeout=10).text
        assert listing.count("<Key>fleet/blobs/") == 2  # the version's two files, in the bucket
        assert_peft_tokens(engines, base, adapter, "poet")
        assert requests_at(cp, MANIFEST_ROUTE) == 2  # each engine asked the control plane for the manifest…
        assert requests_at(cp, FILE_ROUTE) == 0  # …and took the bytes from moto
        size = sum((adapter / n).stat().st_size for n in (CONFIG_NAME, WEIGHTS_NAME))
        assert [e.metric("loraplane_artifact_fetch_bytes_total") for e in engines.values()] == [size, size]
