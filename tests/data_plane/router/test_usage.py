"""usage.py against a real engine's stream bytes: the router reads every chunk's usage (vLLM's
continuous_usage_stats) and gives the client what it asked for, however the bytes are cut into reads.

The oracle is the stream as the engine sent it, parsed with the json module: what the client gets is
each event with its `usage` taken out (asked nothing), set to null (asked include_usage), or untouched
(asked continuous usage too), the last usage event only when asked; and the usage seen is each chunk's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from data_plane.router.usage import Reservation, Usage, UsageTap, ask_for_usage, check_ceiling, reservation
from shared.errors import InvalidRequestError
from tests.data_plane.api.conftest import EngineServer


@pytest.fixture(scope="module")
def engine_stream(lora_engine: EngineServer) -> bytes:
    body = ask_for_usage(json.dumps({"model": "demo", "prompt": "The sea", "max_tokens": 6, "n": 2, "stream": True,
                                     "temperature": 0, "ignore_eos": True}).encode())
    r = httpx.post(lora_engine.api + "/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return r.content


def events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def through(tap: UsageTap, data: bytes, cut: int) -> bytes:
    """The stream fed to the tap in reads of `cut` bytes (the last read shorter)."""
    out = b"".join(tap.feed(data[i:i + cut]) for i in range(0, len(data), cut))
    return out + tap.flush()


def with_fingerprint(stream: bytes) -> bytes:
    """The stream with a field after the last event's usage, as vLLM sends it (`system_fingerprint`)."""
    sent = events(stream)
    last = sent[-2]
    assert last.endswith(b"}}") and b'"choices":[]' in last
    return b"".join(e + b"\n\n" for e in [*sent[:-2], last[:-1] + b',"system_fingerprint":"vllm-0"}', sent[-1]])


@pytest.mark.parametrize(("asked", "continuous"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("fingerprint", [False, True], ids=["usage-last", "fields-after-usage"])
def test_the_client_gets_what_it_asked_and_the_router_every_usage(engine_stream: bytes, asked: bool,
                                                                 continuous: bool, fingerprint: bool) -> None:
    if fingerprint:
        engine_stream = with_fingerprint(engine_stream)
    sent = events(engine_stream)
    chunks = [json.loads(e[6:]) for e in sent if e != b"data: [DONE]"]
    assert all("usage" in c for c in chunks) and chunks[-1]["choices"] == []
    expected = []
    for chunk in chunks:
        if not chunk["choices"]:
            if asked:
                expected.append(chunk)
            continue
        if not continuous:
            chunk = {k: v for k, v in chunk.items() if k != "usage"}
            if asked:
                chunk["usage"] = None
        expected.append(chunk)
    for cut in (1, 7, 64, len(engine_stream)):
        seen: list[Usage] = []
        tap = UsageTap(Reservation(1, 6, asked, continuous), seen.append)
        got = events(through(tap, engine_stream, cut))
        assert got[-1] == b"data: [DONE]"
        assert [json.loads(e[6:]) for e in got[:-1]] == expected, cut
        assert [(u.prompt_tokens, u.completion_tokens) for u in seen] == [
            (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks]
        assert tap.usage == seen[-1] and tap.usage.completion_tokens == 2 * 6


def test_an_event_that_is_not_a_usage_passes_untouched() -> None:
    odd = (b'data: {"error":{"message":"x","type":"y","param":null,"code":null}}\n\n'
           b'data: {"choices":[{"text":"\\",\\"usage\\":{}"}],"usage":"weird"}\n\n')
    tap = UsageTap(Reservation(1, 1), lambda u: pytest.fail("no usage here"))
    assert through(tap, odd, 5) == odd and tap.usage is None


def test_reservation_reads_max_tokens_the_prompt_and_what_the_stream_asked() -> None:
    r = reservation(b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":40,'
                    b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}}', 256)
    assert (r.generated, r.asked_usage, r.asked_continuous) == (40, True, True) and r.tokens == 40 + r.prompt
    # "abcdefgh" with its quotes: 10 bytes, an estimate of 10 // 4 + 1 tokens; OpenAI's default max_tokens
    r = reservation(b'{"model":"m","prompt":"abcdefgh","stream_options":{"continuous_usage_stats":true}}', 256)
    assert (r.prompt, r.generated, r.asked_usage, r.asked_continuous) == (3, 16, False, False)


@pytest.mark.parametrize(("body", "context", "prompt", "generated"), [
    # token ids are counted, however they are spaced; every sample of every prompt may generate max_tokens
    (b'{"prompt": [ 3, 1, 4, 1, 5 ], "n": 3, "max_tokens": 10}', 256, 5, 3 * 10),
    (b'{"prompt": [[3, 1], [4, 1, 5, 9], [2]], "n": 2, "max_tokens": 7}', 256, 2 + 4 + 1, 3 * 2 * 7),
    (b'{"prompt": [-1]}', 256, 1, 16),
    # text prompts are estimated one by one: '"abcdefgh"' is 10 bytes, '"xy"' 4
    (b'{"prompt": ["abcdefgh", "xy"], "max_tokens": 5}', 256, 3 + 2, 2 * 5),
    # best_of counts when it outnumbers n, in completions (chat has none)
    (b'{"prompt": [1, 2], "n": 2, "best_of": 5, "max_tokens": 4}', 256, 2, 5 * 4),
    (b'{"prompt": [1, 2], "n": 6, "best_of": 5, "max_tokens": 4}', 256, 2, 6 * 4),
    (b'{"messages": [1], "n": 2, "best_of": 5, "max_tokens": 4}', 256, 1, 2 * 4),
    # chat without max_tokens: the context left after the prompt's estimate, for each sample
    (b'{"messages": [{"content": "abcdefghijk"}], "n": 4}', 256, 8, 4 * (256 - 8)),
    (b'{"messages": [{"content": "abcdefghijk"}], "max_tokens": null}', 100, 8, 100 - 8),
    # … at least one token, and 16 when the engines did not say what context they have
    (b'{"messages": [{"content": "abcdefghijk"}]}', 5, 8, 1),
    (b'{"messages": [{"content": "abcdefghijk"}]}', None, 8, 16),
    # chat reads max_completion_tokens first, as the engines do; completions only max_tokens
    (b'{"messages": [1], "max_tokens": 50, "max_completion_tokens": 9}', 256, 1, 9),
    (b'{"messages": [1], "max_tokens": 50, "max_completion_tokens": null}', 256, 1, 50),
    (b'{"prompt": [1], "max_tokens": 50, "max_completion_tokens": 9}', 256, 1, 50),
])
def test_the_reservation_counts_every_sample_of_every_prompt(body: bytes, context: int | None, prompt: int,
                                                             generated: int) -> None:
    r = reservation(body, context)
    assert (r.prompt, r.generated) == (prompt, generated)


def test_the_ceiling_names_itself_and_what_to_lower() -> None:
    r = reservation(b'{"prompt": [[1], [2]], "n": 4, "max_tokens": 100}', 256)
    check_ceiling(r, None)
    check_ceiling(r, r.tokens)
    with pytest.raises(InvalidRequestError) as refused:
        check_ceiling(r, r.tokens - 1)
    message = refused.value.message
    assert f"{r.tokens} tokens" in message and f"{r.tokens - 1} tokens per request (--max-request-tokens)" in message
    assert "max_tokens" in message and " n " in message and refused.value.param == "max_tokens"
    asked = json.loads(ask_for_usage(b'{"model":"m","stream_options":{"include_usage":false}}'))
    assert asked["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
