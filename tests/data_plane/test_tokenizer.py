import json
import random
import shutil
from pathlib import Path

import pytest

from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.detokenizer import detokenize_incrementally
from data_plane.tokenizer import Tokenizer
from shared.errors import InvalidRequestError

MULTIBYTE_TEXTS = [
    "Hello, world!",
    "naïve café — déjà vu",
    "日本語のテキストと中文文本",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "mixed: αβγ 한국어 ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0000\x7f end",
]
ENDOFTEXT, IM_START, IM_END = 0, 1, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok_model")
    write_demo_model(out, seed=0)
    return out


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def _copy_tokenizer_only(model_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    return dest


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.convert_ids_to_tokens([ENDOFTEXT, IM_START, IM_END]) == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert tok.all_special_ids == [ENDOFTEXT, IM_START, IM_END]
    assert tok.eos_token_ids == {IM_END, ENDOFTEXT}
    assert tok.pad_token_id == ENDOFTEXT and tok.bos_token_id is None
    assert tok.vocab_size == 4096


def test_eos_ids_union_of_all_sources(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_only(model_dir, tmp_path / "m")
    assert Tokenizer.from_pretrained(d).eos_token_ids == {IM_END}  # tokenizer_config eos_token only
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    assert Tokenizer.from_pretrained(d).eos_token_ids == {IM_END, 7, 8, 9}


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_round_trip_arbitrary_utf8(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_in_text_and_skipping(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_template_raise_exception_becomes_invalid_request(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(InvalidRequestError, match="system message is only allowed as the first"):
        tok.apply_chat_template(messages)


def test_missing_chat_template_is_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_only(model_dir, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match=r"no chat template.*/v1/completions"):
        Tokenizer.from_pretrained(d).apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_file_and_hf_helpers(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_only(model_dir, tmp_path / "m")
    # chat_template.jinja next to the config wins; the helpers HF templates rely on are available.
    (d / "chat_template.jinja").write_text(
        "{{ eos_token }}|{{ bos_token }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
    )
    rendered = Tokenizer.from_pretrained(d).apply_chat_template([{"role": "user", "content": "é"}] * 2)
    assert (
        rendered == '<|im_end|>||[{"role": "user", "content": "é"}, {"role": "user", "content": "é"}]|4|user'
    )


def test_chat_template_sandboxed(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_tokenizer_only(model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        Tokenizer.from_pretrained(d).apply_chat_template([])


def _stream(tok: Tokenizer, ids: list[int], skip: bool, flush_last: bool = True) -> list[str]:
    """Feed ids one at a time, as the engine does; return the emitted pieces."""
    pieces, prefix_offset, read_offset = [], 0, 0
    for n in range(1, len(ids) + 1):
        flush = flush_last and n == len(ids)
        text, prefix_offset, read_offset = detokenize_incrementally(
            tok, ids[:n], prefix_offset, read_offset, skip, flush=flush
        )
        pieces.append(text)
    return pieces


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_streams_multibyte_text(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text) + [IM_END]
    pieces = _stream(tok, ids, skip, flush_last=False)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    # Partial characters are held back, never emitted as U+FFFD.
    assert all("\ufffd" not in piece for piece in pieces)


def test_detokenizer_splits_multibyte_characters_across_tokens(tok: Tokenizer) -> None:
    # The corpus has no emoji, so each of its 4 UTF-8 bytes is a token of its own: nothing is
    # emitted until the character is complete.
    byte_ids = tok.encode("🎉")
    assert len(byte_ids) == 4
    assert _stream(tok, byte_ids, skip=True, flush_last=False) == ["", "", "", "🎉"]


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_full_decode_on_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    byte_token_ids = list(range(3, 3 + 256))  # single-byte tokens: the hardest case for UTF-8 splits
    for _ in range(300):
        ids = [
            rng.choice(byte_token_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 40))
        ]
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_without_flush_holds_only_an_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    partial = ids[:-1]  # the emoji's last token is missing
    assert "".join(_stream(tok, partial, skip=True, flush_last=False)) == "ok "
    assert "".join(_stream(tok, partial, skip=True, flush_last=True)) == tok.decode(partial)
