"""Train the demo model's byte-level BPE tokenizer on the bundled corpus, deterministically.

The pipeline is Qwen2's (NFC, Qwen2's split regex, byte-level BPE), so the files behave like a real
Qwen2 tokenizer; transformers also rebuilds exactly this pipeline for model_type qwen2. Every byte
has a token, so any UTF-8 text encodes and decodes even though the corpus is plain English. The corpus
yields about 4,500 tokens; a larger vocabulary is padded with `<unused{i}>` tokens that encoding never
produces but that decode, as real checkpoints pad theirs.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 2048
# Qwen2's pre-tokenizer split (digits one by one, contractions case-insensitive).
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _package_text(name: str) -> str:
    return resources.files("data_plane.demo").joinpath(name).read_text(encoding="utf-8")


def chat_template() -> str:
    return _package_text("chat_template.jinja")


def train_bpe(lines: list[str], vocab_size: int, min_frequency: int = 1) -> Tokenizer:
    """A byte-level BPE tokenizer with the Qwen2 pipeline and SPECIAL_TOKENS (ids 0-2), trained on lines up to
    vocab_size tokens (fewer when the lines run out of merges); the same lines give the same tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so bytes absent from the corpus (CJK, emoji) still have tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Trainer ties are broken by pair order, not hash order, so the result is reproducible.
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


@functools.lru_cache(maxsize=4)
def build_tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    """Train on corpus.txt and return the tokenizer.json text (cached: training is the slow part), with
    exactly vocab_size tokens: padded as the module says when the corpus yields fewer."""
    lines = [line for line in _package_text("corpus.txt").splitlines() if line.strip()]
    # the corpus is small; frequency-1 merges are needed to reach ~4096
    tok = train_bpe(lines, vocab_size, min_frequency=1)
    text = tok.to_str(pretty=True)
    return text if tok.get_vocab_size() >= vocab_size else padded(text, vocab_size)


def padded(text: str, vocab_size: int) -> str:
    """tokenizer.json text whose BPE vocabulary is filled up to vocab_size with `<unused{id}>` tokens (no
    merge makes them: only decode meets them; `<`, `>` and ASCII letters are their own byte-level symbols)."""
    obj = json.loads(text)
    vocab: dict[str, int] = obj["model"]["vocab"]
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<unused{token_id}>"] = token_id
    return json.dumps(obj, indent=2, ensure_ascii=False)


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of one of SPECIAL_TOKENS (the trainer adds them all, so it is always there)."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token!r} token")
    return token_id


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json content, in the shape transformers' PreTrainedTokenizerFast reads."""
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        # Like Qwen2: no BOS is prepended; the instruct turn ends with <|im_end|>.
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte-level BPE needs no space clean-up; cleaning would make decode lossy.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": chat_template(),
    }


def write_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into out_dir; return the tokenizer."""
    text = build_tokenizer_json(vocab_size)
    tokenizer = Tokenizer.from_str(text)
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    config = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return tokenizer
