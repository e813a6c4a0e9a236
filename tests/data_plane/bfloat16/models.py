"""The bfloat16 closeness tests' checkpoints, adapters and oracle (test-only).

Checkpoints are the tiny random ones of tests/data_plane/checkpoints.py with their matrices drawn at a
larger spread (STD), so the logits are peaked: the greedy token leads the next one by a clear margin
at most positions, bfloat16's rounding rarely flips it, and an op that computes something else moves
the greedy token out of the reference's top 5 instead of to a near-tie. The tokenizer gives every id
its own text ("t17"), so the text keys of the API's top_logprobs map back to ids one to one.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.data_plane.bfloat16.closeness import Greedy
from tests.data_plane.checkpoints import write_tiny_checkpoint
from tests.data_plane.peft_adapters import write_peft_adapter

STD = 1.0
VOCAB = 512
TOP = 5
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}
# name -> peft_adapters kind: three ranks on three sets of targets
ADAPTERS = {"qv-r8": "qv_r8", "qkvo-r16": "qkvo_r16", "mlp-r4": "mlp_r4"}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block: these tiny bfloat16 matmuls are cheap on one thread,
    while on CPUs shared with other test processes each parallel region waits for descheduled workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def token_id(text: str) -> int:
    """The id of a token's text as the API reports it ("t17" -> 17, "<s>" -> 1)."""
    return SPECIAL[text] if text in SPECIAL else int(text.removeprefix("t"))


def write_unique_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer.json whose id i has the text "t{i}" (ids 0-2: <unk>, <s>, </s>)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {**SPECIAL, **{f"t{i}": i for i in range(len(SPECIAL), vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1024}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_model(root: Path, family: str, seed: int = 3) -> tuple[Path, dict[str, Path]]:
    """A peaked float32 checkpoint of `family` with its tokenizer, and the three ADAPTERS on it."""
    base = write_tiny_checkpoint(root / family, family, seed=seed, std=STD)
    write_unique_tokenizer(base)
    adapters = {name: write_peft_adapter(base, root / f"{family}-{name}", kind, seed=seed + i)
                for i, (name, kind) in enumerate(ADAPTERS.items())}
    return base, adapters


def prompts(seed: int = 0) -> list[list[int]]:
    """A 320-token prompt and a 24-token one, of ordinary token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (320, 24)]


def load_reference(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers (+ PEFT) wholly in bfloat16, adapter weights included, generating past eos."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, autocast_adapter_dtype=False).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Greedy:
    """The model's greedy continuation with each position's top-TOP logprobs (from its raw logits)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    top = []
    for logits in out.logits:  # one [1, vocab] per generated position
        values, indices = torch.log_softmax(logits[0].float(), dim=-1).topk(TOP)
        top.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
    return Greedy(out.sequences[0, len(prompt):].tolist(), top)
