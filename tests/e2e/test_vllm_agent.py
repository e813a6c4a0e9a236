"""End to end against a real vLLM: `loraplane agent` makes it an engine of the fleet.

One vLLM server (its CPU build in its own venv: bench/vllm_venv.py) on a 2-layer Llama with head size 64
and vocab 384 in float32, a real control plane with an artifact store, and a real agent process beside
vLLM, all over loopback. An uploaded version reaches vLLM through the agent (fetched by digest into
--adapter-dir, verified), and vLLM's greedy tokens for it are PEFT's by the top-5 closeness rule (vLLM's
op order differs from transformers'); a new version replaces it in place; an unload removes it from vLLM;
a tampered blob in the store is refused before vLLM sees it; a changed cached copy is fetched again; a
bad --engine-url is refused at start; vLLM killed makes the engine unhealthy at the control plane, and
restarted, it gets its adapters back (the agent registers again when vLLM's start time changes).

Without the vLLM venv these tests skip, unless CI is set (then they fail): `make test` creates it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from shared.artifacts import manifest_url
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.data_plane.api.conftest import REPO_ROOT
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    control_plane,
    engine_token,
    signal_group,
    started,
    wait_for,
)
from tests.e2e.test_control_plane_engines import _free_port as free_port

sys.path.insert(0, str(REPO_ROOT / "bench"))
from vllm_venv import VENV_ENV, installed_python, server_env  # noqa: E402  (bench/ is not a package)

torch = pytest.importorskip("torch")

ENGINE = "e3"  # the agent's engine name: one of the control plane's LORAPLANE_ENGINE_CREDENTIALS
SERVED = "tiny"  # vLLM's --served-model-name, the adapters' base_model at the control plane
NEW_TOKENS = 16
TOP = 5
VOCAB = 384


def vllm_python() -> Path:
    python = installed_python()
    if python is None:
        reason = f"vLLM's venv is not set up (python bench/vllm_venv.py, or {VENV_ENV})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: a missing vLLM is a failure there)")
        pytest.skip(reason)
    return python


def write_model(root: Path) -> tuple[Path, dict[str, Path]]:
    """The tiny Llama (head size 64: 128 hidden over 2 heads; vocab 384, each id its own text "t17") and
    adapters on it, each of other weights."""
    from tests.data_plane.bfloat16.models import write_unique_tokenizer
    from tests.data_plane.checkpoints import write_tiny_checkpoint
    from tests.data_plane.peft_adapters import write_peft_adapter

    base = write_tiny_checkpoint(root / "base", "llama", seed=3, std=1.0, vocab_size=VOCAB, hidden_size=128,
                                 num_attention_heads=2, num_key_value_heads=2, intermediate_size=256)
    write_unique_tokenizer(base, VOCAB)
    adapters = {name: write_peft_adapter(base, root / name, "qv_r8", seed=seed)
                for name, seed in (("v1", 11), ("v2", 12), ("guarded", 13), ("other", 14))}
    return base, adapters


@contextlib.contextmanager
def vllm_server(python: Path, base: Path, log: Path, port: int | None = None) -> Iterator[SimpleNamespace]:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--served-model-name",
           SERVED, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
           "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-num-seqs", "4"]
    with started(cmd, log, server_env("0-1", 1), lambda: httpx.get(url + "/health", timeout=2).status_code == 200,
                 "vLLM", timeout_s=240) as process:
        yield SimpleNamespace(url=url, port=port, process=process)


def agent_command(engine_url: str, cp: str, adapter_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "shared.cli", "agent", "--engine-kind", "vllm", "--engine-url", engine_url,
            "--control-plane", cp, "--engine-name", ENGINE, "--adapter-dir", str(adapter_dir), "--port", str(port),
            "--max-lora-rank", "8", "--heartbeat-interval-s", "0.5", "--watch-interval-s", "0.5"]


def agent_env() -> dict[str, str]:
    return {**os.environ, "LORAPLANE_ADMIN_TOKEN": engine_token(ENGINE),
            "LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS[ENGINE]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_agent")
    base, adapters = write_model(tmp / "models")
    root = tmp / "empty-root"
    root.mkdir()
    store = tmp / "store"
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp, root, flags=("--artifact-store", store.as_uri())))
        vllm = stack.enter_context(vllm_server(python, base, tmp / "vllm.log"))
        port = free_port()
        agent = f"http://127.0.0.1:{port}"
        stack.enter_context(started(agent_command(vllm.url, cp, tmp / "adapters", port), tmp / "agent.log",
                                    agent_env(), lambda: httpx.get(agent + "/health", timeout=2).status_code == 200,
                                    "the agent"))
        reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        wait_for(lambda: engine_state(reader, cp) == "healthy", "the agent to register")

        def restart_vllm() -> None:
            stack.enter_context(vllm_server(python, base, tmp / "vllm-again.log", vllm.port))

        yield SimpleNamespace(cp=cp, vllm=vllm, agent=agent, base=base, adapters=adapters, store=store,
                              adapter_dir=tmp / "adapters", reader=reader, tmp=tmp, restart_vllm=restart_vllm,
                              admin=httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120),
                              agent_admin=httpx.Client(base_url=agent, timeout=60,
                                                       headers={"Authorization": f"Bearer {engine_token(ENGINE)}"}))


def engine_state(reader: httpx.Client, cp: str) -> str | None:
    return {e["name"]: e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]}.get(ENGINE)


def upload(fleet: SimpleNamespace, name: str, folder: Path, replicas: str = '{"min": 1, "max": 1}',
           loaded_on: tuple[str, ...] = (ENGINE,), activate: bool = True) -> dict:
    """A version uploaded to the control plane (`fleet.cp`, `fleet.admin`); `loaded_on` the engines it was
    pushed to, each answering loaded."""
    files = {n: (n, (folder / n).read_bytes(), "application/octet-stream") for n in (CONFIG_NAME, WEIGHTS_NAME)}
    r = fleet.admin.post(f"{fleet.cp}/v1/lora_adapters/{name}/versions", files=files,
                         data={"base_model": SERVED, "replicas": replicas, "activate": str(activate).lower()})
    assert r.status_code == 200, r.text
    assert sorted((e["engine"], e["outcome"]) for e in r.json()["engines"]) == [
        (engine, "loaded") for engine in sorted(loaded_on)], r.text
    return r.json()


def vllm_roots(fleet: SimpleNamespace) -> dict[str, str]:
    """vLLM's own listing: each adapter's folder, by name."""
    models = httpx.get(fleet.vllm.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["root"] for m in models if m["parent"] is not None}


def greedy_request(model: str, prompt: list[int]) -> dict:
    """A completion's body: NEW_TOKENS greedy tokens past eos, with each position's top-TOP logprobs."""
    return {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": TOP,
            "ignore_eos": True}


def greedy_of(tokens: list[str], top_logprobs: list[dict[str, float]]):  # noqa: ANN201
    """A completion choice's `logprobs` (token texts "t17") as a Greedy of token ids."""
    from tests.data_plane.bfloat16.closeness import Greedy
    from tests.data_plane.bfloat16.models import token_id

    return Greedy([token_id(t) for t in tokens], [{token_id(t): v for t, v in p.items()} for p in top_logprobs])


def completion_greedy(url: str, model: str, prompt: list[int], headers: dict[str, str] | None = None):  # noqa: ANN201
    """The greedy continuation server `url` answers for `model`."""
    r = httpx.post(url + "/v1/completions", timeout=60, json=greedy_request(model, prompt), headers=headers)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    return greedy_of(logprobs["tokens"], logprobs["top_logprobs"])


def vllm_greedy(fleet: SimpleNamespace, model: str, prompt: list[int]):  # noqa: ANN201
    return completion_greedy(fleet.vllm.url, model, prompt)


def peft_greedy(base: Path, adapter: Path, prompt: list[int]):  # noqa: ANN201
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.data_plane.bfloat16.models import reference_greedy

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    model.generation_config.eos_token_id = None
    return reference_greedy(model, prompt, NEW_TOKENS)


def assert_serves(fleet: SimpleNamespace, name: str, adapter: Path) -> None:
    """vLLM's greedy tokens for `name` are PEFT's for `adapter` by the top-5 closeness rule."""
    from tests.data_plane.bfloat16.closeness import assert_close

    prompt = [5, 17, 42, 99, 200, 7, 311, 64]
    [result] = assert_close([vllm_greedy(fleet, name, prompt)], [peft_greedy(fleet.base, adapter, prompt)], [name])
    assert result.agreed >= 4, result  # the adapter's tokens, not a near-tie from the first position on


def test_an_upload_is_loaded_into_vllm_through_the_agent(fleet: SimpleNamespace) -> None:
    digest = upload(fleet, "poet", fleet.adapters["v1"])["sha256"]
    assert vllm_roots(fleet)["poet"] == str(fleet.adapter_dir / digest)  # the agent's verified copy
    assert (fleet.adapter_dir / digest / WEIGHTS_NAME).read_bytes() == (fleet.adapters["v1"] / WEIGHTS_NAME).read_bytes()
    assert_serves(fleet, "poet", fleet.adapters["v1"])
    [listed] = [a for a in fleet.agent_admin.get("/v1/lora_adapters").json()["adapters"] if a["name"] == "poet"]
    assert (listed["sha256"], listed["residency"], listed["rank"], listed["target_modules"]) == (
        digest, "loaded", 8, ["q_proj", "v_proj"])
    assert httpx.get(fleet.agent + "/v1/lora_adapters", timeout=10).status_code == 401  # the admin token


def test_a_new_version_replaces_the_old_in_place(fleet: SimpleNamespace) -> None:
    before = vllm_roots(fleet)["poet"]
    digest = upload(fleet, "poet", fleet.adapters["v2"])["sha256"]  # activated: loaded in place
    assert vllm_roots(fleet)["poet"] == str(fleet.adapter_dir / digest) != before
    assert_serves(fleet, "poet", fleet.adapters["v2"])


def test_an_unload_removes_it_from_vllm_and_keeps_its_files(fleet: SimpleNamespace) -> None:
    root = vllm_roots(fleet)["poet"]
    r = fleet.admin.post(fleet.cp + "/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert r.status_code == 200, r.text
    assert "poet" not in vllm_roots(fleet)
    assert (Path(root) / WEIGHTS_NAME).exists()  # cached until evicted
    r = fleet.agent_admin.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "lora_name")


def test_a_tampered_blob_is_refused_before_vllm_loads_it(fleet: SimpleNamespace) -> None:
    digest = upload(fleet, "guarded", fleet.adapters["guarded"])["sha256"]
    assert fleet.admin.post(fleet.cp + "/v1/unload_lora_adapter", json={"lora_name": "guarded"}).status_code == 200
    weights = (fleet.adapters["guarded"] / WEIGHTS_NAME).read_bytes()
    blob = next(p for p in (fleet.store / "blobs").rglob("*") if p.is_file() and p.read_bytes() == weights)
    blob.write_bytes(weights[:-4] + bytes(4 * [weights[-1] ^ 0xFF]))  # same size, other bytes
    for f in (fleet.adapter_dir / digest).iterdir():  # the agent's copy gone: it must fetch again
        f.unlink()
    r = fleet.agent_admin.post("/v1/load_lora_adapter", json={
        "lora_name": "guarded", "artifact": {"digest": digest, "url": manifest_url("", digest)}})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("checksum_mismatch", "artifact")
    assert "guarded" not in vllm_roots(fleet)


def test_a_changed_cached_copy_is_fetched_again(fleet: SimpleNamespace) -> None:
    digest = upload(fleet, "other", fleet.adapters["other"])["sha256"]
    cached = fleet.adapter_dir / digest / WEIGHTS_NAME
    good = cached.read_bytes()
    cached.write_bytes(good[:-4] + bytes(4))  # changed behind the agent's back: vLLM must not read it
    assert fleet.agent_admin.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 200
    # loaded again by this call, or by a reconcile before it (the control plane still desires it here)
    r = fleet.agent_admin.post("/v1/load_lora_adapter", json={
        "lora_name": "other", "artifact": {"digest": digest, "url": manifest_url("", digest)}})
    assert r.status_code == 200, r.text
    assert cached.read_bytes() == good
    assert_serves(fleet, "other", fleet.adapters["other"])


def test_a_bad_engine_url_is_refused(fleet: SimpleNamespace) -> None:
    for url, problem in (("http://169.254.169.254:8000", "cloud metadata"), ("http://127.0.0.1:8000/v1", "path"),
                         ("http://user:pw@127.0.0.1:8000", "userinfo")):
        run = subprocess.run(agent_command(url, fleet.cp, fleet.tmp / "unused", 0), env=agent_env(), cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode == 2 and "--engine-url: engine url refused" in run.stderr and problem in run.stderr, \
            run.stderr
        assert "pw" not in run.stderr


def test_vllm_killed_is_unhealthy_and_restarted_gets_its_adapters_back(fleet: SimpleNamespace) -> None:
    assert "other" in vllm_roots(fleet)  # desired here by the control plane
    signal_group(fleet.vllm.process, signal.SIGKILL)  # the server and its engine-core process
    fleet.vllm.process.wait()
    wait_for(lambda: engine_state(fleet.reader, fleet.cp) == "unhealthy", "the control plane to see vLLM down")
    r = httpx.get(fleet.agent + "/health", timeout=10)
    assert r.status_code == 503 and "vLLM" in json.dumps(r.json()), r.text
    fleet.restart_vllm()  # a new process: runtime-loaded adapters are gone, its start time is another
    wait_for(lambda: engine_state(fleet.reader, fleet.cp) == "healthy", "the agent to report vLLM healthy again")
    wait_for(lambda: "other" in vllm_roots(fleet), "the reconcile to load the adapter into the new vLLM")
    assert_serves(fleet, "other", fleet.adapters["other"])
