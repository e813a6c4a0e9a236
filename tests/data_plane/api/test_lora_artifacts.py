"""`artifact` loads through the engine's app: the version fetched by digest from a real loopback server
(what the control plane serves), verified, cached, and served with PEFT's tokens; and the on-demand pull
when the control plane resolves a name to an artifact. The engine has no --lora-roots at all here."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from litestar.testing import TestClient
from peft import PeftModel
from transformers import AutoModelForCausalLM

from data_plane.adapters.artifacts.cache import MANIFEST_NAME
from data_plane.api.app import create_app
from data_plane.control_client import ControlPlaneClient
from data_plane.demo.adapters import write_demo_adapters
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from shared.artifacts import ArtifactRef
from shared.engine_admin import ResolvedAdapter
from tests.data_plane.adapters.artifacts.artifact_server import ArtifactServer, serve_artifacts
from tests.data_plane.api.engines import SERVED, make_engine
from tests.data_plane.api.test_app import assert_openai_error

TOKEN = "engine-token"
LOAD, CHAT = "/v1/load_lora_adapter", "/v1/chat/completions"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("artifact_sources")  # the "upload": never under any root of the engine
    write_demo_adapters(demo_model_dir, root)
    return root


@pytest.fixture
def cp() -> Iterator[ArtifactServer]:
    with serve_artifacts() as server:
        yield server


def artifact_app(demo_model_dir: Path, cp: ArtifactServer, cache_dir: Path, **config) -> TestClient:
    engine = make_engine(demo_model_dir, enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=16,
                         control_plane_url=cp.url, control_plane_token=TOKEN, lora_cache_dir=str(cache_dir), **config)
    assert engine.config.lora_roots == []
    return TestClient(create_app(engine, engine.config), raise_server_exceptions=False)


def load(client: TestClient, name: str, ref: ArtifactRef, **fields):
    return client.post(LOAD, json={"lora_name": name, "artifact": msgspec.to_builtins(ref), **fields})


def written(cache_dir: Path, digest: str) -> Path:
    """The cached folder of `digest` once the cache's background write has put it in place."""
    folder = cache_dir / digest
    deadline = time.monotonic() + 60
    while not (folder / MANIFEST_NAME).exists():
        assert time.monotonic() < deadline, f"{digest[:16]}… was never written into the cache"
        time.sleep(0.01)
    return folder


def chat(client: TestClient, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": NEW_TOKENS,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    return client.post(CHAT, json=body)


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{outcome=\"ok\"}"):
            return float(line.rpartition(" ")[2])
    raise KeyError(name)


def peft_tokens(base: Path, adapter: Path, prompt: list[int]) -> list[int]:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_an_artifact_load_serves_peft_tokens_and_is_fetched_once(demo_model_dir, adapters, cp, tmp_path):
    ref = cp.publish_folder(adapters / "demo-poet")
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        r = load(client, "poet", ref)
        assert r.status_code == 200, r.text
        assert r.json()["sha256"] == ref.digest
        answer = chat(client, "poet").json()
        assert answer["choices"][0]["token_ids"] != chat(client, SERVED).json()["choices"][0]["token_ids"]
        assert answer["choices"][0]["token_ids"] == peft_tokens(demo_model_dir, adapters / "demo-poet",
                                                                answer["prompt_token_ids"])
        assert len(cp.seen) == 3 and all(h["authorization"] == f"Bearer {TOKEN}" for _, h in cp.seen)
        assert load(client, "poet-again", ref).status_code == 200  # the same digest under another name
        assert len(cp.seen) == 3
        assert metric(client, "loraplane_artifact_fetches_total") == 1
        assert metric(client, "loraplane_artifact_cache_hits_total") == 1
        assert metric(client, "loraplane_artifact_fetch_bytes_total") == sum(
            p.stat().st_size for p in (adapters / "demo-poet").iterdir())
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as restarted:  # the same cache dir
        assert load(restarted, "poet", ref).status_code == 200
        assert chat(restarted, "poet").json()["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"]
    assert len(cp.seen) == 3


def test_a_corrupted_file_is_refused_and_the_engine_serves_the_others(demo_model_dir, adapters, cp, tmp_path):
    good, bad = cp.publish_folder(adapters / "demo-poet"), cp.publish_folder(adapters / "demo-short")
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        assert load(client, "poet", good).status_code == 200
        before = chat(client, "poet").json()["choices"][0]["token_ids"]
        cp.corrupt["adapter_model.safetensors"] = b"\0" * len((adapters / "demo-short/adapter_model.safetensors")
                                                              .read_bytes())
        error = assert_openai_error(load(client, "short", bad), 400, "invalid_request_error")
        assert error["message"].startswith("checksum mismatch for adapter_model.safetensors")
        assert (error["code"], error["param"]) == ("checksum_mismatch", "artifact")
        assert_openai_error(chat(client, "short"), 404)  # nothing was loaded from it
        assert chat(client, "poet").json()["choices"][0]["token_ids"] == before
        written(tmp_path / "cache", good.digest)
        assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [good.digest]


def test_untrusted_urls_and_ambiguous_bodies_are_refused(demo_model_dir, adapters, cp, tmp_path):
    with serve_artifacts() as elsewhere, artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        ref = elsewhere.publish_folder(adapters / "demo-poet")
        error = assert_openai_error(load(client, "poet", ref), 400)
        assert "not on a trusted origin" in error["message"] and error["code"] == "untrusted_artifact_origin"
        assert elsewhere.seen == [] and cp.seen == []
        both = load(client, "poet", cp.publish_folder(adapters / "demo-poet"), lora_path=str(adapters / "demo-poet"))
        assert "exactly one of lora_path" in assert_openai_error(both, 400)["message"]
        neither = client.post(LOAD, json={"lora_name": "poet"})
        assert "exactly one of lora_path" in assert_openai_error(neither, 400)["message"]
        published = cp.publish_folder(adapters / "demo-poet")
        for url in ("/v1/artifacts/../v1/engines", f"{cp.url}/v1/artifacts/%2e%2e/v1/tenancy/keys", f"{cp.url}/v1/engines"):
            error = assert_openai_error(load(client, "poet", msgspec.structs.replace(published, url=url)), 400)
            assert error["code"] == "untrusted_artifact_url" and "nothing was fetched" in error["message"], error
        assert cp.seen == []  # the engine's token went nowhere
        # a path load still needs --lora-roots: the cache dir is no root for direct paths elsewhere
        direct = client.post(LOAD, json={"lora_name": "poet", "lora_path": str(adapters / "demo-poet")})
        assert "no LoRA roots are configured" in assert_openai_error(direct, 400)["message"]
        assert cp.seen == []


def test_a_download_in_progress_holds_up_no_other_request(demo_model_dir, adapters, cp, tmp_path):
    poet, short = cp.publish_folder(adapters / "demo-poet"), cp.publish_folder(adapters / "demo-short")
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        assert load(client, "poet", poet).status_code == 200
        cp.hold = threading.Event()  # file bodies now wait until released
        outcome: dict[str, int] = {}
        loading = threading.Thread(target=lambda: outcome.update(status=load(client, "short", short).status_code))
        loading.start()
        try:
            while not any(p.startswith(f"/v1/artifacts/{short.digest}/") for p in cp.paths()):
                loading.join(0.01)
            assert chat(client, "poet").status_code == 200  # decoding other adapters goes on meanwhile
            assert "status" not in outcome  # the download is still in progress
        finally:
            cp.hold.set()
            loading.join(60)
        assert outcome == {"status": 200}
        assert chat(client, "short").status_code == 200


def test_a_download_rests_while_the_engine_serves_and_runs_flat_out_while_idle(demo_model_dir, adapters, cp,
                                                                               tmp_path):
    """The download paces itself by the engine's requests in flight (a quarter of a CPU while it serves) and
    still finishes while a request is being generated; the cache's copy waits for the engine to be quiet."""
    poet, short = cp.publish_folder(adapters / "demo-poet"), cp.publish_folder(adapters / "demo-short")
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        engine, portal = client.app.state.engine, client.blocking_portal
        assert load(client, "poet", poet).status_code == 200
        written(tmp_path / "cache", poet.digest)
        assert metric(client, "loraplane_artifact_paced_seconds_total") == 0  # idle: nothing rested
        # a request in flight: its first output read, the rest left waiting until the generator is closed
        generation = engine.generate(Request("in-flight", [1, 2, 3], SamplingParams(max_tokens=8)))
        portal.call(anext, generation)
        try:
            assert engine.num_requests() == 1
            assert load(client, "short", short).status_code == 200  # fetched, verified and loaded meanwhile
            time.sleep(1.5)
            assert not (tmp_path / "cache" / short.digest / MANIFEST_NAME).exists()  # held back while serving
            assert engine.num_requests() == 1
        finally:
            portal.call(generation.aclose)
        assert engine.num_requests() == 0
        written(tmp_path / "cache", short.digest)  # a second after the request ended
        assert metric(client, "loraplane_artifact_paced_seconds_total") > 0


def test_a_name_resolved_to_an_artifact_is_fetched_on_demand(demo_model_dir, adapters, cp, tmp_path):
    ref = cp.publish_folder(adapters / "demo-poet")
    cp.resolves["poet"] = msgspec.json.encode(ResolvedAdapter(
        name="poet", version=1, uri="/nowhere/the/engine/can/read", sha256=ref.digest, artifact=ref))
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        resolver = ControlPlaneClient(cp.url, TOKEN, name="e1", engine_url="http://127.0.0.1:1", base_model=SERVED,
                                      slots_total=2, heartbeat_s=3600)
        client.app.state.resolver.remote = resolver.resolve
        client.blocking_portal.call(resolver.start)  # on the app's loop, as attach_control_plane does
        try:
            r = chat(client, "poet")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == peft_tokens(demo_model_dir, adapters / "demo-poet",
                                                                      r.json()["prompt_token_ids"])
        finally:
            client.blocking_portal.call(resolver.stop)
    assert [p for p in cp.paths() if p.startswith("/v1/artifacts/")][0] == f"/v1/artifacts/{ref.digest}"


def test_the_cache_flags_reach_the_config(demo_model_dir, tmp_path, monkeypatch):
    from data_plane.api.server import build_parser, config_from_args
    from data_plane.config import ConfigError

    def config(*flags: str):
        return config_from_args(build_parser().parse_args([str(demo_model_dir), "--enable-lora", *flags]))

    default = config()
    assert (default.lora_cache_dir, default.lora_cache_max_bytes, default.lora_artifact_endpoint) == (None, 8 << 30, None)
    given = config("--lora-cache-dir", str(tmp_path), "--lora-cache-max-bytes", "1000",
                   "--lora-artifact-endpoint", "https://s3.example:9000")
    assert (given.lora_cache_dir, given.lora_cache_max_bytes, given.lora_artifact_endpoint) == (
        str(tmp_path), 1000, "https://s3.example:9000")
    monkeypatch.setenv("LORAPLANE_ARTIFACT_ENDPOINT", "http://minio:9000")
    assert config().lora_artifact_endpoint == "http://minio:9000"
    with pytest.raises(ConfigError, match="--lora-artifact-endpoint 's3://b'"):
        config("--lora-artifact-endpoint", "s3://b")
    with pytest.raises(ConfigError, match="--lora-cache-max-bytes"):
        config("--lora-cache-max-bytes", "0")


def test_a_cached_version_changed_on_disk_is_fetched_again_not_served(demo_model_dir, adapters, cp, tmp_path):
    ref = cp.publish_folder(adapters / "demo-poet")
    with artifact_app(demo_model_dir, cp, tmp_path / "cache") as client:
        assert load(client, "poet", ref).status_code == 200
        expected = chat(client, "poet").json()["choices"][0]["token_ids"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        cached = written(tmp_path / "cache", ref.digest) / "adapter_model.safetensors"
        data = bytearray(cached.read_bytes())
        data[-1] ^= 0xFF  # same size: the cache's cheap check passes, the loader's digest does not
        cached.write_bytes(bytes(data))
        assert load(client, "poet", ref).status_code == 200
        assert len(cp.seen) == 6  # fetched a second time
        written(tmp_path / "cache", ref.digest)
        assert cached.read_bytes() == (adapters / "demo-poet" / "adapter_model.safetensors").read_bytes()
        assert chat(client, "poet").json()["choices"][0]["token_ids"] == expected


def test_the_cache_never_evicts_what_the_registry_serves(demo_model_dir, adapters, cp, tmp_path):
    poet, short = cp.publish_folder(adapters / "demo-poet"), cp.publish_folder(adapters / "demo-short")
    biggest = max(sum(p.stat().st_size for p in (adapters / n).iterdir()) for n in ("demo-poet", "demo-short"))
    with artifact_app(demo_model_dir, cp, tmp_path / "cache", lora_cache_max_bytes=biggest) as client:
        assert load(client, "poet", poet).status_code == 200
        error = assert_openai_error(load(client, "short", short), 503)
        assert error["code"] == "lora_cache_full"
        assert chat(client, "poet").status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        assert load(client, "short", short).status_code == 200  # poet's files, no longer served, made room
        assert metric(client, "loraplane_artifact_cache_evictions_total") == 1
        assert not (tmp_path / "cache" / poet.digest).exists()
