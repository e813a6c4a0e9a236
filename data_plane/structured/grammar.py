"""Structured outputs with llguidance: a constraint's grammar text, the tokenizer llguidance masks over,
and a matcher per constrained sequence.

The grammar text (llguidance's serialized top-level grammar) is what the API process checks and hands the
engine core; building a matcher from it compiles the lexer against the vocabulary, so the core keeps a
template matcher per grammar text (MatcherCache) and gives each sequence a copy. Adapters share the base
model's vocabulary, so one compiled grammar serves every adapter.

JSON has no free whitespace: items are separated by "," and keys by ":" (vLLM's disable_any_whitespace),
so a schema that bounds its values bounds the output. A schema's own "x-guidance" options may say otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import llguidance
import torch

from data_plane.structured.constraint import Constraint
from data_plane.tokenizer import Tokenizer
from shared.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# llguidance's rejection messages can quote the whole grammar: a client reads the start of it
MAX_REASON_CHARS = 1000


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint; ValueError when the schema is not a JSON object. Whether
    the grammar itself is valid is known only once a matcher is built from it (`new_matcher`)."""
    kind, text = constraint.kind, constraint.text
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)  # Lark (llguidance's dialect), or GBNF turned into Lark


class UnsupportedTokenizer(ValueError):
    """llguidance cannot read this model's tokenizer: the model serves, without structured outputs."""


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The vocabulary llguidance masks over, built from the `tokenizers` JSON (no transformers); vocab_size:
    the model's logits width, so a bitmask covers every logit. Slow for large vocabularies: build it once.
    UnsupportedTokenizer when llguidance cannot read the tokenizer."""
    eos = sorted(tokenizer.eos_token_ids)
    try:
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
    except Exception as exc:  # noqa: BLE001 (whatever llguidance raises on a tokenizer it cannot read)
        raise UnsupportedTokenizer(
            f"structured outputs are not available for this model: the grammar library cannot read its "
            f"tokenizer ({str(exc)[:200]})") from exc


class LLVocabulary:
    """A tokenizer's LLTokenizer, built once, on first use (any thread); UnsupportedTokenizer on every use
    when llguidance cannot read the tokenizer (it is tried once: the tokenizer does not change)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._built: llguidance.LLTokenizer | UnsupportedTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                try:
                    self._built = ll_tokenizer(self._tokenizer, self._vocab_size)
                except UnsupportedTokenizer as exc:
                    self._built = exc
        if isinstance(self._built, UnsupportedTokenizer):
            raise self._built
        return self._built

    def warm(self) -> None:
        """Build it now rather than on the first constrained request; a tokenizer llguidance cannot read is
        logged, and the model serves without structured outputs."""
        try:
            self.get()
        except UnsupportedTokenizer as exc:
            logger.warning("%s", exc)


def build_matcher(ll_tok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher | str:
    """A matcher at the grammar's start, or why llguidance rejects the grammar."""
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        return matcher.get_error()[:MAX_REASON_CHARS]
    return matcher


def rejected(param: str, reason: str) -> InvalidRequestError:
    """The 400 of a constraint that cannot be used."""
    return InvalidRequestError(f"The {param} constraint is not valid: {reason}", param=param)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One constrained sequence's position in its grammar: advanced with each token it samples, never
    with the tokens a recomputation (after preemption) feeds the model again."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @staticmethod
    def fill_masks(executor: llguidance.LLExecutor, matchers: list[GrammarMatcher], words: int) -> list[torch.Tensor | None]:
        """Each matcher's next-token bitmask, [words] int32 (bit t % 32 of word t // 32 allows token t),
        filled at once on the executor's threads; None for a matcher whose grammar allows no token (a dead
        end) or is in error."""
        masks = torch.zeros(len(matchers), words, dtype=torch.int32)  # [R, W]
        executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)], masks.data_ptr(),
                                         words * 4, len(matchers))
        allowed = masks.any(dim=1).tolist()
        return [masks[i] if allowed[i] and not m._matcher.is_error() else None for i, m in enumerate(matchers)]

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token; False when the grammar does not allow it (the matcher is then in error)."""
        return self._matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token: the sequence ends here."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()[:MAX_REASON_CHARS] or "the grammar allows no further token"


class MatcherCache:
    """The engine core's grammars: a template matcher per grammar text (least recently used dropped first),
    copied for each sequence. The LLTokenizer is built by `warm` (the engine does at startup), else on the
    first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, size: int) -> None:
        self.vocabulary = LLVocabulary(tokenizer, vocab_size)
        self._words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        self._size = max(1, size)
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the LLTokenizer now (at startup), not on the step of the first constrained request."""
        self.vocabulary.warm()

    def new(self, grammar: str, param: str = "structured_outputs") -> GrammarMatcher:
        """A matcher at the grammar's start for one sequence; a 400 naming `param` when llguidance rejects it."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
            else:
                try:
                    built = build_matcher(self.vocabulary.get(), grammar)
                except UnsupportedTokenizer as exc:
                    raise rejected(param, str(exc)) from None
                if isinstance(built, str):
                    raise rejected(param, built)
                template = built
                self._templates[grammar] = template
                if len(self._templates) > self._size:
                    self._templates.popitem(last=False)
            return GrammarMatcher(template.deep_copy())

    def masks(self, matchers: list[GrammarMatcher]) -> list[torch.Tensor | None]:
        """The matchers' next-token bitmasks (GrammarMatcher.fill_masks), computed side by side on the torch threads'
        count of llguidance threads: between two forward passes those CPUs are free."""
        return GrammarMatcher.fill_masks(self._executor, matchers, self._words)
