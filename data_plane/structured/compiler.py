"""The API process's side of structured outputs: check a constraint and compile it before the request is
admitted, so that a bad one is a 400 and the engine core gets a grammar it can build a matcher from.

Compiling (a matcher built against the vocabulary) runs on a small thread pool, never on the event loop,
and the request waits at most --structured-output-compile-timeout seconds for it. Results, rejections
included, are kept per constraint in a bounded LRU (--structured-output-cache-size); one compiler serves
one tokenizer, so the constraint alone is the key. A compile that outlives its request's wait still fills
the cache. A constraint's text longer than --max-structured-output-bytes is refused before any work.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from data_plane.structured.constraint import Constraint
from data_plane.structured.grammar import (
    MAX_REASON_CHARS,
    LLVocabulary,
    build_matcher,
    grammar_text,
    rejected,
)
from data_plane.tokenizer import Tokenizer
from shared.errors import InvalidRequestError

_EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraplane-grammar")


class Constrained(Protocol):
    """What carries a constraint: SamplingParams.structured_outputs (data_plane/engine/sampling_params.py)."""

    def constraint(self) -> Constraint: ...


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, timeout_s: float, max_bytes: int,
                 cache_size: int) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache_size = max(1, cache_size)
        self.hits = 0
        self.misses = 0
        # constraint -> (its grammar text, None) or (None, why it was rejected)
        self._cache: OrderedDict[Constraint, tuple[str | None, str | None]] = OrderedDict()
        self._lock = threading.Lock()  # the cache's
        self._vocabulary = LLVocabulary(tokenizer, vocab_size)  # built once, slowly: not under the cache's lock

    async def grammar_of(self, structured_outputs: Constrained | None, param: str) -> str | None:
        """The grammar text of a request's SamplingParams.structured_outputs (None: unconstrained), whatever
        set it (response_format, structured_outputs, a tool choice): the one check every request passes."""
        return None if structured_outputs is None else await self.compile(structured_outputs.constraint(), param)

    async def compile(self, constraint: Constraint, param: str) -> str:
        """The constraint's grammar text; a 400 naming `param` when it is too long, rejected, or not
        compiled within the timeout."""
        size = len(constraint.text.encode())
        if size > self.max_bytes:
            raise InvalidRequestError(
                f"The {param} constraint is {size} bytes; this engine takes at most {self.max_bytes} "
                "(--max-structured-output-bytes).", param=param)
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
            else:
                self.misses += 1
        if cached is None:
            started = time.monotonic()
            future = asyncio.get_running_loop().run_in_executor(_EXECUTOR, self._compile, constraint)
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)  # never cancels the compile
            # a compile that finished late is late, however soon the loop noticed
            if not done or time.monotonic() - started > self.timeout_s:
                raise InvalidRequestError(
                    f"The {param} constraint did not compile within {self.timeout_s:g} s "
                    "(--structured-output-compile-timeout); simplify it.", param=param)
            cached = future.result()
        grammar, reason = cached
        if grammar is None:
            raise rejected(param, reason or "rejected")
        return grammar

    def warm(self) -> None:
        """Build the vocabulary's LLTokenizer now (on the compile threads), not on the first request."""
        _EXECUTOR.submit(self._vocabulary.warm)

    def _compile(self, constraint: Constraint) -> tuple[str | None, str | None]:
        """On a compile thread: (grammar text, None) or (None, why it is rejected); either is cached."""
        result: tuple[str | None, str | None]
        try:
            grammar = grammar_text(constraint)
            built = build_matcher(self._vocabulary.get(), grammar)
            result = (None, built) if isinstance(built, str) else (grammar, None)
        except Exception as exc:  # noqa: BLE001 (whatever the library raises on a constraint is the client's 400)
            result = (None, str(exc)[:MAX_REASON_CHARS] or type(exc).__name__)
        with self._lock:
            self._cache[constraint] = result
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result
