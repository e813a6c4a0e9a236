"""Prompt text → token ids: only for prompts that can fit the context, and never on the event loop.

Tokenizing (and rendering a chat template) costs time in proportion to the text: megabytes take
seconds, and on the event loop those seconds stall every other request and /health. So a prompt is
refused by its character count first (--max-prompt-chars, see PROMPT_CHARS_PER_TOKEN in
data_plane/config.py), and what remains is encoded on a small pool of threads (the Rust tokenizer
releases the GIL; two threads keep a burst of big prompts from taking every core from the engine).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shared.errors import InvalidRequestError

T = TypeVar("T")
_EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraplane-tokenize")


def check_prompt_chars(chars: int, limit: int, param: str) -> None:
    """Refuse a prompt of more than `limit` characters before any tokenizing."""
    if chars > limit:
        raise InvalidRequestError(
            f"The prompt has {chars} characters; this engine refuses prompts of more than {limit} "
            "characters (--max-prompt-chars), as they cannot fit its context.",
            param=param,
            code="context_length_exceeded",
        )


async def off_loop(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run fn(*args, **kwargs) on the tokenizer threads; its exceptions propagate."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))
