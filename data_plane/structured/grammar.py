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

import threading
from collections import OrderedDict

import llguidance
import torch

from data_plane.structured.constraint import Constraint
from data_plane.tokenizer import Tokenizer
from shared.errors import InvalidRequestError

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


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The vocabulary llguidance masks over, built from the `tokenizers` JSON (no transformers); vocab_size:
    the model's logits width, so a bitmask covers every logit. Slow for large vocabularies: build it once."""
    eos = sorted(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)


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

    def allowed_tokens(self) -> torch.Tensor | None:
        """The next token's bitmask, [ceil(V/32)] int32; None when the grammar allows no token (a dead end)
        or is in error."""
        mask = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        if self._matcher.is_error() or not bool(mask.any()):
            return None
        return mask

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
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._size = max(1, size)
        self._ll_tok: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the LLTokenizer now (at startup), not on the step of the first constrained request."""
        with self._lock:
            self._ll_tokenizer()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tok is None:
            self._ll_tok = ll_tokenizer(self._tokenizer, self._vocab_size)
        return self._ll_tok

    def new(self, grammar: str, param: str = "structured_outputs") -> GrammarMatcher:
        """A matcher at the grammar's start for one sequence; a 400 naming `param` when llguidance rejects it."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
            else:
                built = build_matcher(self._ll_tokenizer(), grammar)
                if isinstance(built, str):
                    raise rejected(param, built)
                template = built
                self._templates[grammar] = template
                if len(self._templates) > self._size:
                    self._templates.popitem(last=False)
            return GrammarMatcher(template.deep_copy())

