"""One API request is checked whole before any step, and one that fills the batch delays another's first token
by one engine step: real `loraplane engine` processes over HTTP, the official openai client, and the engine's
own figures from /metrics (steps run, prompt tokens admitted, queues, steps to a first token).

A completion of several prompts makes one engine request per prompt, n sequences each: the engine counts
prompts x n against --max-waiting-requests (400 when it can never fit, 503 when it would but not now) and
prompts x n x (prompt + max_tokens) against --max-request-tokens, and nothing of a refused request reaches
the engine core. The scheduler's fair share (data_plane/engine/fair_share.py) admits a request that arrives
beside one that fills the batch at the next step (README, "Limits").
"""

from __future__ import annotations

import pytest

from tests.data_plane.api.conftest import SERVED_NAME, EngineServer

openai = pytest.importorskip("openai")

FLAGS = ("--max-model-len", "512", "--num-kv-blocks", "512", "--max-request-body-bytes", "262144")
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
FIRST_TOKEN_STEP_BOUND = 1  # README: a request beside one that fills the batch gets its first token at the next step
# what an admitted request changes: steps run, prompt tokens admitted and looked up in the KV cache, queues
ENGINE_FIGURES = ("loraplane_step_adapters_count", "loraplane_prompt_tokens_total",
                  "loraplane_prefix_cache_queried_tokens_total", "loraplane_waiting_sequences",
                  "loraplane_running_sequences")


def client_of(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=300)


def figures(server: EngineServer) -> dict[str, float]:
    return {name: server.metric(name) for name in ENGINE_FIGURES}


def test_a_request_that_can_never_fit_is_refused_before_any_step(start_engine):
    server = start_engine(*FLAGS)  # the default limits: 1024 waiting sequences, n up to 128
    client = client_of(server)
    client.completions.create(model=SERVED_NAME, prompt="warm up", max_tokens=2, **GREEDY)
    before = figures(server)
    rejected = server.metric("loraplane_requests_total", 'outcome="rejected"')
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SERVED_NAME, prompt=["hello world"] * 64, n=128, max_tokens=256)
    message = refused.value.body["message"]
    assert "64 prompts × n=128 = 8192 sequences" in message, message
    assert "at most 1024 waiting (--max-waiting-requests)" in message, message
    assert refused.value.body["param"] == "prompt"
    # no step ran, no prompt token was admitted or looked up, nothing was queued
    assert figures(server) == before
    assert server.metric("loraplane_requests_total", 'outcome="rejected"') - rejected == 64


def test_a_request_that_would_fit_but_not_now_gets_503_and_the_token_ceiling_holds(start_engine):
    server = start_engine(*FLAGS, "--max-num-seqs", "2", "--max-waiting-requests", "4",
                          "--max-request-tokens", "2000")
    client = client_of(server)
    # two prompts x n=2: two sequences run, two wait (for about 400 steps)
    running = client.completions.create(model=SERVED_NAME, prompt=["one", "two"], n=2, max_tokens=400, stream=True,
                                        **GREEDY)
    next(iter(running))
    assert server.metric("loraplane_waiting_sequences") == 2
    with pytest.raises(openai.APIStatusError) as busy:  # 4 sequences fit the queue, but 2 of its 4 are taken
        client.completions.create(model=SERVED_NAME, prompt=["three", "four"], n=2, max_tokens=8)
    assert busy.value.status_code == 503
    assert "2 prompts × n=2 = 4 sequences" in busy.value.body["message"]
    assert "of which 2 are taken" in busy.value.body["message"]
    with pytest.raises(openai.BadRequestError) as never:  # 6 sequences never fit a queue of 4
        client.completions.create(model=SERVED_NAME, prompt=["a", "b", "c"], n=2, max_tokens=8)
    assert "3 prompts × n=2 = 6 sequences; this engine admits at most 4 waiting" in never.value.body["message"]
    with pytest.raises(openai.BadRequestError) as tokens:  # 4 x (prompt + 500) tokens, over the ceiling
        client.completions.create(model=SERVED_NAME, prompt=["a", "b"], n=2, max_tokens=500)
    assert "(--max-request-tokens)" in tokens.value.body["message"] and tokens.value.body["param"] == "max_tokens"
    assert server.metric("loraplane_waiting_sequences") == 2  # the refused requests queued nothing
    running.close()


def test_a_request_that_fills_the_batch_delays_a_small_ones_first_token_by_one_step(start_engine):
    server = start_engine(*FLAGS, "--max-num-seqs", "8")
    client = client_of(server)
    # four prompts x n=2 take every one of the 8 seats for 400 steps
    big = client.completions.create(model=SERVED_NAME, prompt=["hello world"] * 4, n=2, max_tokens=400, stream=True,
                                    stream_options={"include_usage": True}, **GREEDY)
    chunks = iter(big)
    started: set[int] = set()
    while len(started) < 4:  # each prompt's first token is out (and counted in the steps histogram)
        chunk = next(chunks)
        started |= {c.index // 2 for c in chunk.choices}
    assert server.metric("loraplane_running_sequences") == 8
    steps_sum = server.metric("loraplane_time_to_first_token_steps_sum")
    steps_count = server.metric("loraplane_time_to_first_token_steps_count")
    small = client.completions.create(model=SERVED_NAME, prompt="The sea", max_tokens=4, **GREEDY)
    assert small.usage.completion_tokens == 4
    assert server.metric("loraplane_running_sequences") >= 7  # ended while the big request still runs
    assert server.metric("loraplane_time_to_first_token_steps_count") - steps_count == 1  # the small one's
    assert server.metric("loraplane_time_to_first_token_steps_sum") - steps_sum <= FIRST_TOKEN_STEP_BOUND
    # the big request ends whole: its preempted sequence was recomputed and finished its 400 tokens
    finished, usage = set(), None
    for chunk in chunks:
        finished |= {c.index for c in chunk.choices if c.finish_reason == "length"}
        usage = chunk.usage or usage
    assert finished == set(range(8)) and usage is not None and usage.completion_tokens == 8 * 400
    assert server.metric("loraplane_num_preemptions_total") >= 1
