"""Tokenizer for a Hugging Face model directory, built on `tokenizers` + jinja2 (no transformers).

Reads tokenizer.json, tokenizer_config.json, config.json and generation_config.json; renders chat
templates the way transformers does (sandboxed jinja2, trim_blocks + lstrip_blocks, same helpers).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from shared.errors import InvalidRequestError, UnsupportedModelError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)  # a Hugging Face config file: a JSON object
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are either a string or a serialized AddedToken dict."""
    content: str | None = value.get("content") if isinstance(value, dict) else value
    return content


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same signature and defaults as transformers' override (jinja's own tojson HTML-escapes).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _select_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which then wins over the config entry.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class Tokenizer:
    """Encode, decode and chat-template a model directory's tokenizer."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        tokenizer_config: dict[str, Any],
        model_config: dict[str, Any],
        generation_config: dict[str, Any],
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token: str | None = _token_content(tokenizer_config.get("bos_token"))
        self.eos_token: str | None = _token_content(tokenizer_config.get("eos_token"))
        self.pad_token: str | None = _token_content(tokenizer_config.get("pad_token"))
        self.model_max_length: int | None = tokenizer_config.get("model_max_length")
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

        # A sequence stops at any of these: chat models end turns with e.g. <|im_end|> while the
        # config may only name <|endoftext|>, so take the union of every place that names one.
        eos = set(_as_id_list(generation_config.get("eos_token_id")))
        eos.update(_as_id_list(model_config.get("eos_token_id")))
        if self.eos_token is not None and (eos_id := tokenizer.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: set[int] = eos

        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, tok in added.items() if tok.special)
        self.pad_token_id: int | None = self.token_to_id(self.pad_token)
        self.bos_token_id: int | None = self.token_to_id(self.bos_token)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UnsupportedModelError(
                f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)"
            )
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        return cls(
            tokenizer=_HFTokenizer.from_file(str(tokenizer_file)),
            tokenizer_config=tokenizer_config,
            model_config=_read_json(model_dir / "config.json"),
            generation_config=_read_json(model_dir / "generation_config.json"),
            chat_template=_select_chat_template(model_dir, tokenizer_config),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` serializes it (tokenizer.json's content)."""
        return self._tok.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render the conversation to prompt text; extra kwargs (tools, …) go to the template."""
        if self._template is None:
            raise InvalidRequestError(
                "This model has no chat template, so chat requests cannot be rendered; "
                "use /v1/completions with a plain prompt instead.",
                param="messages",
                code="no_chat_template",
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **template_kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            # raise_exception() in a template reports a bad conversation: the caller's fault.
            raise InvalidRequestError(f"Chat template error: {e}", param="messages") from e
