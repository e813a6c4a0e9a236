"""The cases the structured-output tests share, and the oracle of constrained greedy decoding: transformers'
float32 logits, masked step by step with the tokens an llguidance matcher allows (built here from
tokenizer.json, independently of the engine's code)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import llguidance
import torch
from transformers import AutoModelForCausalLM

from data_plane.tokenizer import Tokenizer

# bounded: every answer is complete within MAX_TOKENS, whatever the random weights prefer
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "maxItems": 2},
    },
    "required": ["kind", "name", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 60
# "a", then a terminal no text matches: the grammar allows one token, then none
DEAD_END = 'start: "a" b\nb: /[^\\s\\S]/'
PROMPTS = [[11, 42, 7, 99, 23, 5], [300, 17, 8], [5, 6, 7, 8, 9, 10, 11, 12]]


def json_grammar(schema: dict) -> str:
    """The grammar the engine's rule gives a JSON schema: no whitespace beyond "," and ":"."""
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


def eos_ids(model_dir: Path) -> list[int]:
    """Every id that ends a sequence (the configs' and the tokenizer's): the grammar allows them when complete."""
    return sorted(Tokenizer.from_pretrained(model_dir).eos_token_ids)


@functools.cache
def _oracle(model_dir: Path) -> tuple[AutoModelForCausalLM, llguidance.LLTokenizer, list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = eos_ids(model_dir)
    ll_tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), ll_tok, eos


def constrained_greedy(model_dir: Path, prompt: list[int], grammar: str, max_tokens: int) -> list[int]:
    """Greedy tokens under the grammar: EOS (kept, as the engine reports it) or a complete grammar ends them."""
    model, ll_tok, eos = _oracle(model_dir)
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(ids).logits[0, -1].clone()
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
            logits[~allowed] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            assert matcher.consume_token(token), matcher.get_error()
            if token in eos or matcher.is_stopped():
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
