"""`logit_bias` through a real `loraplane engine` (engine-core process, demo model with an adapter, CPU),
spoken to by the official `openai` client, greedy. Oracles: transformers' float32 logits with the bias
added (argmax per step), and the same server's unbiased answers for the requests beside a biased one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from data_plane.demo.adapters import write_demo_adapters
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine

openai = pytest.importorskip("openai")

PROMPT = [11, 42, 7, 99, 23, 5]
NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    root = tmp_path_factory.mktemp("logit_bias")
    pirate = write_demo_adapters(demo_model_dir, root / "adapters", names=["demo-pirate"])["demo-pirate"]
    flags = [*SHARED_FLAGS, "--enable-lora", "--max-loras", "2", "--lora-modules", f"demo-pirate={pirate}"]
    with run_engine(demo_model_dir, root / "engine.log", *flags) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server: EngineServer):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vocab_size(demo_model_dir: Path) -> int:
    return int(json.loads((demo_model_dir / "config.json").read_text())["vocab_size"])


def tokens(client, model: str = "demo", **fields) -> list[list[int]]:
    extra = {**EXTRA, **fields.pop("extra_body", {})}
    r = client.completions.create(model=model, prompt=PROMPT, **{**GREEDY, **fields}, extra_body=extra)
    return [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]


def hf_greedy(model_dir: Path, bias: dict[int, float]) -> list[int]:
    """Greedy tokens of transformers' float32 model with `bias` added to the logits at every step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids).logits[0, -1].clone()
            for token, value in bias.items():
                logits[token] += value
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_a_plus_100_bias_makes_every_token_that_token_for_every_sample(client):
    unbiased = tokens(client)[0]
    chosen = next(t for t in range(3, 200) if t not in unbiased)
    assert tokens(client, n=2, logit_bias={str(chosen): 100}) == [[chosen] * NEW_TOKENS] * 2
    chat = client.chat.completions.create(
        model="demo-pirate", messages=[{"role": "user", "content": "Ahoy"}], **GREEDY,
        logit_bias={str(chosen): 100}, extra_body=EXTRA,
    )
    assert chat.choices[0].model_extra["token_ids"] == [chosen] * NEW_TOKENS


def test_a_minus_100_bias_follows_transformers_and_leaves_its_neighbours_unchanged(client, demo_model_dir):
    [unbiased] = tokens(client)
    assert unbiased == hf_greedy(demo_model_dir, {})  # the oracle agrees with the server unbiased
    pirate_alone = tokens(client, model="demo-pirate", max_tokens=200)[0]
    bias = {unbiased[0]: -100.0}

    # a long unbiased request of another adapter is running when the biased one arrives
    pirate_stream = client.completions.create(
        model="demo-pirate", prompt=PROMPT, temperature=0.0, max_tokens=200, stream=True, extra_body=EXTRA
    )
    pirate_tokens: list[int] = []
    chunks = iter(pirate_stream)
    for chunk in chunks:
        pirate_tokens += chunk.choices[0].model_extra.get("token_ids") or []
        if pirate_tokens:
            break
    neighbours: list[list[list[int]]] = []
    plain = threading.Thread(target=lambda: neighbours.append(tokens(client)))
    plain.start()
    [biased] = tokens(client, logit_bias={str(t): v for t, v in bias.items()})
    plain.join()
    for chunk in chunks:
        pirate_tokens += chunk.choices[0].model_extra.get("token_ids") or []

    assert biased[0] != unbiased[0]
    assert biased == hf_greedy(demo_model_dir, bias)
    assert neighbours == [[unbiased]]
    assert pirate_tokens == pirate_alone


def test_streamed_chat_with_a_bias_equals_the_non_streamed_answer(client):
    fields = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about the sea."}], **GREEDY}
    plain = client.chat.completions.create(**fields, extra_body=EXTRA).choices[0]
    first = plain.model_extra["token_ids"][0]
    biased = {**fields, "logit_bias": {str(first): -100}}
    whole = client.chat.completions.create(**biased, extra_body=EXTRA).choices[0]
    streamed = list(client.chat.completions.create(**biased, stream=True, extra_body=EXTRA))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    streamed_ids = [t for c in streamed if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert whole.model_extra["token_ids"][0] != first
    assert streamed_ids == whole.model_extra["token_ids"] and text == whole.message.content


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "bias",
    [
        lambda v: {str(v): 1},  # outside the vocabulary
        lambda v: {"-1": 1},
        lambda v: {"abc": 1},
        lambda v: {"1.5": 1},
        lambda v: {"1": 100.5},
        lambda v: {"1": -101},
        lambda v: {str(i): 1 for i in range(301)},  # more than 300 entries
    ],
    ids=["out-of-vocab", "negative-id", "non-integer", "fractional-id", "above-100", "below-100", "301-entries"],
)
def test_bad_logit_bias_is_a_400_naming_the_field(client, vocab_size, kind, stream, bias):
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                logit_bias=bias(vocab_size), stream=stream,
            )
        else:
            client.completions.create(model="demo", prompt="hi", max_tokens=2, logit_bias=bias(vocab_size), stream=stream)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "logit_bias" and "logit_bias" in body["message"] and "not supported" not in body["message"]
